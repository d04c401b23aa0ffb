from __future__ import annotations

import time
from pathlib import Path

from corral.node.store import SCHEMA_VERSION, SandboxRecord, Store


def _rec(
    sid: str, state: str = "running", labels: dict[str, str] | None = None, memory: int = 100
) -> SandboxRecord:
    now = time.time()
    return SandboxRecord(
        id=sid,
        kind="container",
        state=state,
        spec={"memory": memory},
        layers=["sha256:a"],
        image_env=["PATH=/bin"],
        workdir="/",
        created_at=now,
        expires_at=None,
        last_active=now,
        owner="1:2",
        labels=labels or {},
    )


def test_migrations_set_the_schema_version(tmp_path: Path) -> None:
    s = Store(tmp_path / "state.db")
    assert s.db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    s.close()
    Store(tmp_path / "state.db").close()  # reopening migrates nothing


def test_records_labels_and_counts(tmp_path: Path) -> None:
    s = Store(tmp_path / "state.db")
    s.insert(_rec("n-1", labels={"job": "a", "team": "x"}))
    s.insert(_rec("n-2", labels={"job": "b"}))
    s.insert(_rec("n-3", state="closed", labels={"job": "a"}))
    assert [r.id for r in s.list(labels={"job": "a"})] == ["n-1"]
    assert [r.id for r in s.list(labels={"job": "a", "team": "x"})] == ["n-1"]
    assert s.list(labels={"job": "zzz"}) == []
    assert s.count_active() == (2, 200)
    got = s.get("n-1")
    assert got is not None and got.labels == {"job": "a", "team": "x"}
    assert s.get("nope") is None


def test_only_one_transition_wins(tmp_path: Path) -> None:
    s = Store(tmp_path / "state.db")
    s.insert(_rec("n-1"))
    assert s.transition("n-1", ["running"], "closing") is True
    assert s.transition("n-1", ["running"], "closing") is False


def test_resources_are_kept_until_dropped_and_block_purging(tmp_path: Path) -> None:
    s = Store(tmp_path / "state.db")
    s.insert(_rec("n-1", state="closed"))
    s.update("n-1", closed_at=0.0)
    s.add_resource("n-1", "dir", "/x")
    s.add_resource("n-1", "subvolume", "n-1")
    assert s.resources("n-1") == [("subvolume", "n-1"), ("dir", "/x")]  # newest first
    assert s.purge_closed(time.time()) == 0
    s.drop_resource("n-1", "dir", "/x")
    s.drop_resource("n-1", "subvolume", "n-1")
    assert s.purge_closed(time.time()) == 1
    assert s.get("n-1") is None


def test_touch_only_moves_forward(tmp_path: Path) -> None:
    s = Store(tmp_path / "state.db")
    s.insert(_rec("n-1"))
    rec = s.get("n-1")
    assert rec is not None
    s.touch({"n-1": rec.last_active + 10})
    s.touch({"n-1": rec.last_active + 5})
    again = s.get("n-1")
    assert again is not None and again.last_active == rec.last_active + 10


def test_two_processes_share_one_store(tmp_path: Path) -> None:
    a, b = Store(tmp_path / "state.db"), Store(tmp_path / "state.db")
    with a.transaction():
        a.insert(_rec("n-1"))
    assert b.get("n-1") is not None
