from __future__ import annotations

import time
from pathlib import Path

import pytest

from corral.errors import ResourceExhausted
from corral.node.store import SCHEMA_VERSION, Promised, SandboxRecord, Store


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
    assert s.count_active() == 2
    assert s.promised() == Promised(sandboxes=2, memory=200, cpu=0.0, disk=0)
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


def test_promised_sums_active_sandboxes_only(tmp_path: Path) -> None:
    s = Store(tmp_path / "state.db")
    for sid, state, spec in [
        ("n-1", "running", {"memory": 100, "cpu": 0.5, "disk": 7}),
        ("n-2", "suspended", {"memory": 50, "cpu": 1.0, "disk": 3}),
        ("n-3", "closed", {"memory": 999, "cpu": 8.0, "disk": 999}),
    ]:
        rec = _rec(sid, state=state)
        rec.spec = spec
        s.insert(rec)
    assert s.promised() == Promised(sandboxes=2, memory=150, cpu=1.5, disk=10)
    assert s.active_ids() == {"n-1", "n-2"}


def test_housekeeping_is_answered_only_what_is_due(tmp_path: Path) -> None:
    """The tick's questions answer the due sandboxes, not all held."""
    s = Store(tmp_path / "state.db")
    now = 1000.0

    def add(sid: str, *, state: str = "running", kind: str = "container", **kw: object) -> None:
        rec = _rec(sid, state=state, labels=kw.pop("labels", None))  # type: ignore[arg-type]
        rec.kind, rec.last_active = kind, float(kw.pop("last_active", now))  # type: ignore[arg-type]
        rec.expires_at = kw.pop("expires_at", None)  # type: ignore[assignment]
        rec.spec = {"memory": 1, "idle_timeout": kw.pop("idle", None)}
        if "on_expiry" in kw:
            rec.spec["on_expiry"] = kw.pop("on_expiry")
        rec.init_pid, rec.init_start = 42, 7
        rec.suspended = kw.pop("suspended", None)  # type: ignore[assignment]
        s.insert(rec)

    add("ttl", expires_at=now - 1)
    add("ttl-later", expires_at=now + 1)
    add("idle", idle=30.0, last_active=now - 31)
    add("idle-not-yet", idle=30.0, last_active=now - 29)
    add("no-timeout", last_active=now - 10_000)
    add("ttl-closed", state="closed", expires_at=now - 1)
    add("vm", kind="microvm", last_active=now - 100)
    add("pooled", labels={"corral.pool": "warm"}, last_active=now - 100)
    add("frozen", state="suspended", suspended="freeze", last_active=now - 100)
    add("on-disk", state="suspended", suspended="disk", last_active=now - 10_000)
    add("ttl-suspends", expires_at=now - 1, on_expiry="disk", last_active=now - 1)
    # An idle one closes whatever its TTL's end would do.
    add("idle-suspends", idle=30.0, last_active=now - 40, on_expiry="suspend")
    assert s.due_to_retire(now) == [
        ("idle-suspends", "idle for 30s", "close"),
        ("idle", "idle for 30s", "close"),
        ("ttl-suspends", "ttl expired", "disk"),
        ("ttl", "ttl expired", "close"),
    ]
    assert {sid for sid, _, _ in s.running_inits()} == {
        "ttl", "ttl-later", "idle", "idle-not-yet", "no-timeout", "vm", "pooled", "ttl-suspends",
        "idle-suspends",
    }  # fmt: skip
    assert set(s.running_ids(["microvm"])) == {"vm"}
    assert s.running_labelled("corral.pool") == [("pooled", "1:2")]
    # Memory back once per idle spell: marked, not asked again until used.
    kinds = ("container", "microvm")
    assert [sid for sid, _ in s.idle_unreclaimed(kinds, now - 50, 10)] == [
        "no-timeout", "pooled", "vm"
    ]  # fmt: skip
    assert [sid for sid, _ in s.idle_unreclaimed(kinds, now - 50, 1)] == ["no-timeout"]
    s.mark_reclaimed("no-timeout", now - 10_000)
    assert [sid for sid, _ in s.idle_unreclaimed(kinds, now - 50, 10)] == ["pooled", "vm"]
    s.touch({"no-timeout": now - 60})  # a command: a new idle spell
    assert "no-timeout" in [sid for sid, _ in s.idle_unreclaimed(kinds, now - 50, 10)]
    # Suspension: a pool's never; frozen ones only once due for the disk.
    got = {r[0]: r[2] for r in s.idle_to_suspend(kinds, now - 50, None, "corral.pool")}
    assert got == {"no-timeout": "running", "vm": "running"}
    got = {r[0]: r[2] for r in s.idle_to_suspend(kinds, now - 50, now - 90, "corral.pool")}
    assert got == {"no-timeout": "running", "vm": "running", "frozen": "suspended"}
    assert s.idle_to_suspend([], now, now, "corral.pool") == []


def test_id_blocks_and_address_blocks_fill_the_lowest_gap(tmp_path: Path) -> None:
    s = Store(tmp_path / "state.db")
    for sid in ("a", "b", "c"):
        s.insert(_rec(sid))
    assert [s.idmap_allocate(sid, 4) for sid in ("a", "b", "c")] == [0, 1, 2]
    s.idmap_free("b")
    s.insert(_rec("d"))
    s.insert(_rec("e"))
    assert s.idmap_allocate("d", 4) == 1  # the gap first
    assert s.idmap_allocate("e", 4) == 3
    s.insert(_rec("f"))
    with pytest.raises(ResourceExhausted, match="all 4 blocks of host ids"):
        s.idmap_allocate("f", 4)
    s.idmap_free("a")
    assert s.idmap_allocate("f", 4) == 0
    # Address blocks start at 1 (block 0 is the node's own).
    assert [s.net_allocate(sid, "{}", 3) for sid in ("a", "b")] == [1, 2]
    with pytest.raises(ResourceExhausted, match="all 2 sandbox address blocks"):
        s.net_allocate("c", "{}", 3)


def test_networked_own_disks_are_listed_for_their_dhcp(tmp_path: Path) -> None:
    s = Store(tmp_path / "s.db")
    for sid, image, state, net in [
        ("disk-net", "disk:win11", "running", True),
        ("disk-no-net", "disk:win11", "running", False),
        ("disk-closed", "disk:win11", "closed", True),
        ("image-net", "debian:12", "running", True),
    ]:
        rec = _rec(sid, state=state)
        rec.kind, rec.spec = "fullvm", {"memory": 1, "image": image}
        s.insert(rec)
        if net:
            s.net_allocate(sid, "{}", 64)
    assert s.running_networked_own_disks() == [("disk-net", "1:2")]


def test_ids_in_states_and_kinds(tmp_path: Path) -> None:
    """The housekeeping's view of which sandboxes' logs to bound: a VM
    writes its console while it is created, too."""
    s = Store(tmp_path / "state.db")
    s.insert(_rec("n-1"))
    s.insert(_rec("n-2", state="creating"))
    s.insert(_rec("n-3", state="closed"))
    assert sorted(s.ids_in(["creating", "running"])) == ["n-1", "n-2"]
    assert s.ids_in(["creating", "running"], ["microvm"]) == []
    assert s.running_ids(["container"]) == ["n-1"]
