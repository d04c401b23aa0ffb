"""CPU classes without a kernel: the partition of a node's cores by load,
the kernel's list format, a sandbox's effective class as commands come and
go, and the node configuration's bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.config import NodeConfig
from corral.errors import InvalidArgument
from corral.node.cpuclasses import (
    BACKGROUND,
    INTERACTIVE,
    REAPPLY_EVERY,
    CpuClasses,
    Partition,
    background_cores,
    cpu_list,
    partition,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("cpus", "text"),
    [
        ([0], "0"),
        ([0, 1], "0-1"),
        ([0, 1, 2, 5], "0-2,5"),
        ([3, 1, 2], "1-3"),
        ([0, 2, 4], "0,2,4"),
    ],
)
def test_cpu_lists_are_written_as_the_kernel_reads_them(cpus: list[int], text: str) -> None:
    assert cpu_list(cpus) == text


@pytest.mark.parametrize(
    ("busy", "n", "reserve", "k"),
    [
        (0.0, 2, 1, 0),  # nothing in the background: every core shared
        (0.1, 2, 1, 1),  # any background work gets a core of its own
        (4.0, 2, 1, 1),  # never more than leaves the interactive reserve
        (2.5, 16, 4, 3),  # what the busy sandboxes asked, rounded up
        (40.0, 16, 4, 12),
        (1.0, 1, 1, 0),  # one core: nothing to partition
    ],
)
def test_background_cores_follow_the_load(busy: float, n: int, reserve: int, k: int) -> None:
    assert background_cores(busy, n, reserve) == k


def test_a_partition_gives_background_the_last_cores() -> None:
    p = partition(list(range(8)), 3)
    assert (p.interactive, p.background, p.k) == ("0-4", "5-7", 3)
    assert p.cpus(BACKGROUND) == "5-7" and p.cpus(INTERACTIVE) == "0-4"
    shared = partition(list(range(8)), 0)
    assert shared.interactive == shared.background == "0-7"
    # Not confined: interactive work may use every core.
    spill = partition(list(range(8)), 3, confine=False)
    assert (spill.interactive, spill.background) == ("0-7", "5-7")


class FakeCgroups:
    """The cgroup files a CpuClasses writes, kept in a dict (a unit test's
    transport seam; the integration test reads the kernel's)."""

    def __init__(self) -> None:
        self.idle: dict[str, bool] = {}
        self.cpus: dict[str, str] = {}

    def set_cpu_class(self, sid: str, background: bool, cpus: str, cpu: float) -> None:
        self.idle[sid], self.cpus[sid] = background, cpus

    def cpu_idle(self, sid: str) -> bool | None:
        return self.idle.get(sid)

    def set_cpuset(self, sid: str, cpus: str) -> None:
        self.cpus[sid] = cpus


def classes(tmp_path: Path, confine: bool = True) -> tuple[CpuClasses, FakeCgroups]:
    cg = FakeCgroups()
    c = CpuClasses(
        cg,  # type: ignore[arg-type]
        tmp_path,
        enabled=True,
        interactive_cores=1,
        confine_interactive=confine,
    )
    c.cpus = [0, 1]
    return c, cg


def test_a_command_lifts_or_lowers_its_sandbox_while_it_runs(tmp_path: Path) -> None:
    c, cg = classes(tmp_path)
    c.place("bg", BACKGROUND, 1.0)
    c.place("it", INTERACTIVE, 1.0)
    assert cg.idle == {"bg": True, "it": False}
    # An interactive command in a background sandbox lifts it, then it falls back.
    c.begin("bg", INTERACTIVE, BACKGROUND, 1.0)
    assert cg.idle["bg"] is False
    c.end("bg", INTERACTIVE)
    assert cg.idle["bg"] is True
    # A background command in an interactive sandbox lowers it only while
    # nothing interactive runs beside it.
    c.begin("it", BACKGROUND, INTERACTIVE, 1.0)
    assert cg.idle["it"] is True
    c.begin("it", INTERACTIVE, INTERACTIVE, 1.0)
    assert cg.idle["it"] is False
    c.end("it", INTERACTIVE)
    assert cg.idle["it"] is True
    c.end("it", BACKGROUND)
    assert cg.idle["it"] is False


def test_busy_background_work_moves_the_cores_and_every_sandbox_follows(tmp_path: Path) -> None:
    c, cg = classes(tmp_path)
    c.place("bg", BACKGROUND, 1.0)
    c.place("it", INTERACTIVE, 1.0)

    def rebalance(now: float) -> Partition | None:
        new = c.resize(now)
        if new is not None:
            c.reapply(["bg", "it"], new)
        return new

    first = rebalance(100.0)  # the first full pass: idle, all shared
    assert first is not None and first.k == 0
    assert cg.cpus == {"bg": "0-1", "it": "0-1"}
    assert rebalance(100.5) is None  # nothing moved: no pass until REAPPLY_EVERY
    c.begin("bg", BACKGROUND, BACKGROUND, 1.0)
    moved = rebalance(101.0)
    assert moved is not None and (moved.interactive, moved.background) == ("0", "1")
    assert cg.cpus == {"bg": "1", "it": "0"}
    # Another agent of the node reads the same partition.
    other, _ = classes(tmp_path)
    assert other.current() == moved
    c.end("bg", BACKGROUND)
    assert rebalance(102.0) is not None
    assert cg.cpus == {"bg": "0-1", "it": "0-1"}
    assert rebalance(102.0 + REAPPLY_EVERY) is not None  # and again, every REAPPLY_EVERY


def test_a_dead_agents_markers_do_not_hold_cores(tmp_path: Path) -> None:
    c, _ = classes(tmp_path)
    (tmp_path / "cpu-busy" / "sbx1.999999999").write_text("4")  # no such pid
    assert c.busy_cpu() == 0.0
    assert not (tmp_path / "cpu-busy" / "sbx1.999999999").exists()


def test_classes_off_write_nothing(tmp_path: Path) -> None:
    cg = FakeCgroups()
    c = CpuClasses(cg, tmp_path, enabled=False, interactive_cores=1)  # type: ignore[arg-type]
    c.place("bg", BACKGROUND, 1.0)
    c.begin("bg", BACKGROUND, BACKGROUND, 1.0)
    assert cg.idle == {} and c.resize(now=1.0) is None


@pytest.mark.parametrize("value", [0, -1, 5000])
def test_interactive_cores_out_of_range_are_refused(value: int) -> None:
    with pytest.raises(InvalidArgument) as exc:
        NodeConfig(cpu_interactive_cores=value)
    assert exc.value.field == "cpu_interactive_cores" and "from 1 to 4096" in exc.value.rule
    assert str(value) in str(exc.value)


def test_classes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_CPU_CLASSES", "off")
    monkeypatch.setenv("CORRAL_CPU_INTERACTIVE_CORES", "3")
    cfg = NodeConfig.from_env()
    assert (cfg.cpu_classes, cfg.cpu_interactive_cores) == (False, 3)
