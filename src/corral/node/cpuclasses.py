"""CPU classes: interactive work (an agent waits on it) is kept fast while
background work (builds, test suites, installs) soaks up what is left.

A sandbox has a class (CreateSandbox.cpu_class) and a command may override
it (ExecRequest.cpu_class). Three levers, each with one job:

- The sandbox's cgroup: a background sandbox's group is *idle* (cpu.idle,
  or the smallest weight where the kernel lacks it), so at the level where
  sandboxes compete its whole tree yields to any interactive one. The
  scheduler weighs groups, not processes: only this lever holds one
  sandbox back from another.
- SCHED_IDLE on a background command's processes (corral-init sets it in
  the child before exec): orders one sandbox's own commands.
- cpusets: while background work runs, it is confined to the last k cores
  and interactive sandboxes to the others, so an interactive step never
  waits behind a background task's time slice or its cache footprint.
  k follows the load (the CPUs asked by the background sandboxes busy now),
  between 1 and the node's cores less `cpu_interactive_cores`; with no
  background work busy, every sandbox may use every core.

A sandbox's *effective* class is interactive while any interactive command
runs in it, else background while a background command runs, else the class
it was created with: a command the agent waits on lifts its whole sandbox
for as long as it runs (the scheduler cannot weigh one process of a group
apart from the group), and a background command in an interactive sandbox
makes it background only while nothing interactive runs beside it.

Several agents may serve one node. The cgroup files are the shared truth
of each sandbox's effective class; the partition (which cores are whose)
is decided by the node's housekeeping leader and kept in
<run>/cpu-partition; which sandboxes have background work running is one
marker file each per agent in <run>/cpu-busy (a dead agent's are pruned).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from corral.host.cgroups import Cgroups
from corral.log import get_logger

log = get_logger("corral.node")

INTERACTIVE, BACKGROUND = "interactive", "background"
CLASSES = (INTERACTIVE, BACKGROUND)

# The partition is re-applied to every sandbox at least this often, though
# it did not change: a sandbox placed by another agent while the leader
# moved the cores heals within this many seconds.
REAPPLY_EVERY = 30.0


def cpu_list(cpus: list[int]) -> str:
    """The kernel's list format: [0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    start = prev = None
    for c in [*sorted(cpus), None]:
        if start is not None and (c is None or c != prev + 1):  # type: ignore[operator]
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if c is not None and start is None:
            start = c
        prev = c
    return ",".join(out)


@dataclass(frozen=True)
class Partition:
    """Which cores each class may use now."""

    interactive: str
    background: str
    k: int  # cores given to background work alone (0: none, all shared)

    def cpus(self, cls: str) -> str:
        return self.background if cls == BACKGROUND else self.interactive


def partition(cpus: list[int], k: int, confine: bool = True) -> Partition:
    """Background work on the last k cores; interactive on the others, or
    (confine False) on every core, preempting background work at once on
    its k (an idle group yields to any other)."""
    every = cpu_list(cpus)
    if k <= 0 or k >= len(cpus):
        return Partition(every, every, 0)
    interactive = cpu_list(cpus[: len(cpus) - k]) if confine else every
    return Partition(interactive, cpu_list(cpus[len(cpus) - k :]), k)


def background_cores(busy_cpu: float, n: int, reserve: int) -> int:
    """How many cores background work gets: what the busy background
    sandboxes asked for, rounded up, at least 1 while any is busy, never
    more than leaves `reserve` cores to interactive work."""
    if busy_cpu <= 0 or n <= reserve:
        return 0
    return max(1, min(math.ceil(busy_cpu - 1e-9), n - reserve))


class CpuClasses:
    def __init__(
        self,
        cgroups: Cgroups,
        run_dir: Path,
        *,
        enabled: bool,
        interactive_cores: int,
        confine_interactive: bool = True,
    ) -> None:
        self.cgroups = cgroups
        self.enabled = enabled
        self.confine = confine_interactive
        self.cpus = sorted(os.sched_getaffinity(0))
        self.reserve = interactive_cores
        self.partition_file = run_dir / "cpu-partition"
        self.busy_dir = run_dir / "cpu-busy"
        # Commands this agent runs now, per sandbox: [interactive, background].
        self._running: dict[str, list[int]] = {}
        self._created: dict[str, tuple[str, float]] = {}  # class it was made with, its CPUs
        self._effective: dict[str, str] = {}
        self._cached: tuple[float, Partition] | None = None
        self._last_full = 0.0
        if enabled:
            self.busy_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------ per sandbox

    def place(self, sandbox_id: str, cls: str, cpu: float) -> None:
        """A sandbox just started (or came back): its cgroup joins its class."""
        self._created[sandbox_id] = (cls, cpu)
        if self.enabled:
            self._apply(sandbox_id, self._class_of(sandbox_id))

    def forget(self, sandbox_id: str) -> None:
        self._created.pop(sandbox_id, None)
        self._effective.pop(sandbox_id, None)
        if self._running.pop(sandbox_id, None) is not None:
            self._marker(sandbox_id).unlink(missing_ok=True)

    def command_class(self, sandbox_id: str, asked: str | None, default: str) -> str:
        """The class a command runs in: what it asked for, else its
        sandbox's."""
        return asked or self._created.get(sandbox_id, (default, 0.0))[0]

    def begin(self, sandbox_id: str, cls: str, default: str, cpu: float) -> None:
        """A command of class `cls` starts in the sandbox."""
        self._created.setdefault(sandbox_id, (default, cpu))
        counts = self._running.setdefault(sandbox_id, [0, 0])
        counts[cls == BACKGROUND] += 1
        if self.enabled:
            self._changed(sandbox_id)

    def end(self, sandbox_id: str, cls: str) -> None:
        counts = self._running.get(sandbox_id)
        if counts is None:
            return
        counts[cls == BACKGROUND] -= 1
        if counts == [0, 0]:
            del self._running[sandbox_id]
        if self.enabled:
            self._changed(sandbox_id)

    def _class_of(self, sandbox_id: str) -> str:
        interactive, background = self._running.get(sandbox_id, (0, 0))
        if interactive:
            return INTERACTIVE
        if background:
            return BACKGROUND
        return self._created.get(sandbox_id, (INTERACTIVE, 0.0))[0]

    def _changed(self, sandbox_id: str) -> None:
        busy = self._running.get(sandbox_id, (0, 0))
        marker = self._marker(sandbox_id)
        if busy[0] == 0 and busy[1] > 0:  # background work running, nothing interactive
            if not marker.exists():
                with contextlib.suppress(OSError):
                    marker.write_text(str(self._created.get(sandbox_id, ("", 1.0))[1]))
        else:
            marker.unlink(missing_ok=True)
        cls = self._class_of(sandbox_id)
        if self._effective.get(sandbox_id) != cls:
            self._apply(sandbox_id, cls)

    def _apply(self, sandbox_id: str, cls: str) -> None:
        self._effective[sandbox_id] = cls
        try:
            cpu = self._created.get(sandbox_id, ("", 1.0))[1]
            self.cgroups.set_cpu_class(sandbox_id, cls == BACKGROUND, self.current().cpus(cls), cpu)
        except OSError as exc:  # gone meanwhile, or a kernel without the file
            log.debug("cpu_class.not_applied", sandbox=sandbox_id, error=str(exc))

    def _marker(self, sandbox_id: str) -> Path:
        return self.busy_dir / f"{sandbox_id}.{os.getpid()}"

    # ------------------------------------------------------------ the node's cores

    def current(self) -> Partition:
        """The partition the leader last decided (all cores shared if none)."""
        try:
            mtime = self.partition_file.stat().st_mtime
        except OSError:
            return partition(self.cpus, 0, self.confine)
        if self._cached is None or self._cached[0] != mtime:
            try:
                k = int(self.partition_file.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                k = 0
            self._cached = (mtime, partition(self.cpus, k, self.confine))
        return self._cached[1]

    def busy_cpu(self) -> float:
        """CPUs asked by the sandboxes running background work now, on
        every agent of the node (markers of dead agents removed)."""
        total, seen = 0.0, set()
        try:
            names = os.listdir(self.busy_dir)
        except OSError:
            return 0.0
        for name in names:
            sandbox_id, _, pid = name.rpartition(".")
            try:
                os.kill(int(pid), 0)
            except (ProcessLookupError, ValueError):
                (self.busy_dir / name).unlink(missing_ok=True)
                continue
            except PermissionError:
                pass
            if sandbox_id in seen:
                continue
            seen.add(sandbox_id)
            with contextlib.suppress(OSError, ValueError):
                total += float((self.busy_dir / name).read_text() or 1.0)
        return total

    def resize(self, now: float) -> Partition | None:
        """The leader's tick: size the background cores to the load.
        Returns the partition every sandbox is to be given now (the cores
        moved, or REAPPLY_EVERY passed since the last full pass), else None:
        the caller lists the sandboxes only then (reapply)."""
        if not self.enabled:
            return None
        k = background_cores(self.busy_cpu(), len(self.cpus), self.reserve)
        before = self.current()
        changed = k != before.k
        if changed:
            tmp = self.partition_file.with_suffix(".tmp")
            tmp.write_text(f"{k}\n")
            os.replace(tmp, self.partition_file)
        if not changed and now - self._last_full < REAPPLY_EVERY:
            return None
        self._last_full = now
        new = self.current()
        if changed:
            log.info("cpu_class.partition", interactive=new.interactive, background=new.background)
        return new

    def reapply(self, sandbox_ids: Iterable[str], new: Partition) -> None:
        """Give every sandbox its class's cores of `new` (a write per
        sandbox: off the event loop)."""
        for sid in sandbox_ids:
            background = self.cgroups.cpu_idle(sid)
            if background is None:
                continue
            with contextlib.suppress(OSError):
                self.cgroups.set_cpuset(sid, new.cpus(BACKGROUND if background else INTERACTIVE))
