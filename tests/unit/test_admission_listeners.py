"""The seccomp daemon's open files as an admission limit: each container
holds one (its listener), so past the daemon's RLIMIT_NOFILE a create is
refused as NodeFull naming that limit, not failed by crun mid-start; other
kinds are not counted; a refusal records nothing. Real SQLite store, no
root."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from corral.api.models import CreateSandbox
from corral.config import NodeConfig
from corral.errors import NodeFull
from corral.guard.seccompd import OWN_FILES, listener_capacity
from corral.node.admission import Admission, HostLoad
from corral.node.store import SandboxRecord, Store


def _rec(sid: str, kind: str) -> SandboxRecord:
    now = time.time()
    return SandboxRecord(
        id=sid, kind=kind, state="creating", spec={"memory": 1 << 20}, layers=[],
        image_env=[], workdir="/", created_at=now, expires_at=None, last_active=now,
        owner="1:2",
    )  # fmt: skip


def _admission(tmp_path: Path, most: int) -> tuple[Admission, Store]:
    cfg = NodeConfig(node="lim", userns=False)  # its data dir is never touched here
    store = Store(tmp_path / "state.db")
    quiet = HostLoad(mem_available=None, stalls={})
    admission = Admission(
        cfg, store, 64 << 30, 16, measure=lambda: quiet,
        listeners=(most, frozenset({"container"})),
    )  # fmt: skip
    return admission, store


def _admit(admission: Admission, sid: str, kind: str = "container") -> None:
    req = CreateSandbox(kind=kind, image="debian:bookworm", memory=64 << 20)
    admission.admit(req, _rec(sid, kind), [])


def test_containers_past_the_daemons_files_are_refused_by_name(tmp_path: Path) -> None:
    admission, store = _admission(tmp_path, most=2)
    _admit(admission, "lim-1")
    _admit(admission, "lim-2", kind="microvm")  # holds no listener
    _admit(admission, "lim-3")
    with pytest.raises(NodeFull) as exc:
        _admit(admission, "lim-4")
    assert exc.value.details["reason"] == "seccomp_files"
    assert "2 sandboxes hold a seccomp listener" in exc.value.message
    assert "RLIMIT_NOFILE" in exc.value.message and "is 2" in exc.value.message
    assert store.get("lim-4") is None  # nothing recorded
    _admit(admission, "lim-5", kind="microvm")  # other kinds still fit
    assert store.transition("lim-1", ["creating"], "failed")
    _admit(admission, "lim-6")  # a freed listener is taken again


def test_the_count_is_by_kind_and_active_state(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    store.insert(_rec("a", "container"))
    store.insert(_rec("b", "microvm"))
    store.insert(_rec("c", "container"))
    store.transition("c", ["creating"], "failed")
    assert store.count_active() == 2
    assert store.count_active({"container"}) == 1
    assert store.count_active({"container", "microvm"}) == 2
    assert store.count_active(set()) == 0


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("Max open files            20000                20000                files", 20000),
        ("Max open files            1024                 1048576              files", 1024),
        ("Max open files            unlimited            unlimited            files", None),
        ("Max open files            8                    8                    files", 0),
    ],
)
def test_listener_capacity_reads_the_soft_limit(tmp_path: Path, line: str, expected: int) -> None:
    limits = tmp_path / "limits"
    limits.write_text(
        "Limit                     Soft Limit           Hard Limit           Units\n"
        "Max processes             95914                95914                processes\n"
        f"{line}\n"
    )
    want = None if expected is None else max(0, expected - OWN_FILES)
    assert listener_capacity(limits) == want
    assert listener_capacity(tmp_path / "gone") is None
