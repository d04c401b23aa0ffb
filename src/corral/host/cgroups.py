"""Where a sandbox's cgroups live, what they report, and how to remove them.

The OCI runtime creates and fills the cgroups (it writes the limits from the
bundle); this module only names them, reads them and reclaims leftovers.
Supports cgroup v1 (these development hosts: controllers under
/sys/fs/cgroup/<controller>, plus a cgroup2 mount at /sys/fs/cgroup/unified
that makes crun refuse to run unless it is hidden) and pure cgroup v2
(production hosts).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from corral.errors import Unavailable
from corral.host import mounts, spawn
from corral.log import get_logger

log = get_logger("corral.cgroups")

CGROUP_ROOT = Path("/sys/fs/cgroup")
# v2 controllers a sandbox's cgroup must have (its limits), and those it
# uses where the host offers them (cpusets for CPU classes, io limits).
_V2_REQUIRED = ("cpu", "memory", "pids")
_V2_OPTIONAL = ("cpuset", "io")
# Limit files a kernel may lack without a ceiling going: swap accounting.
_OPTIONAL = frozenset({"memory.memsw.limit_in_bytes", "memory.swap.max"})


class Mode(StrEnum):
    V1 = "v1"
    HYBRID = "hybrid"  # v1 controllers plus a cgroup2 mount (crun needs it hidden)
    V2 = "v2"


def detect() -> Mode:
    table = mounts.mount_table()
    if any(mp == str(CGROUP_ROOT) and fs == "cgroup2" for mp, fs, _ in table):
        return Mode.V2
    if any(fs == "cgroup2" for mp, fs, _ in table if mp.startswith(str(CGROUP_ROOT))):
        return Mode.HYBRID
    return Mode.V1


@dataclass(frozen=True)
class IoLimit:
    """Block I/O ceilings on one device (the node's scratch pool)."""

    major: int
    minor: int
    read_bps: int = 0  # 0: no ceiling
    write_bps: int = 0

    def oci(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, rate in (("throttleReadBpsDevice", self.read_bps),
                          ("throttleWriteBpsDevice", self.write_bps)):  # fmt: skip
            if rate:
                out[key] = [{"major": self.major, "minor": self.minor, "rate": rate}]
        return out

    def v1(self) -> list[tuple[str, str]]:
        """The blkio controller's files, as runc and crun write them."""
        dev = f"{self.major}:{self.minor}"
        return [(name, f"{dev} {rate}") for name, rate in
                (("blkio.throttle.read_bps_device", self.read_bps),
                 ("blkio.throttle.write_bps_device", self.write_bps)) if rate]  # fmt: skip

    def v2(self) -> list[tuple[str, str]]:
        rates = [f"{k}={r}" for k, r in (("rbps", self.read_bps), ("wbps", self.write_bps)) if r]
        return [("io.max", f"{self.major}:{self.minor} {' '.join(rates)}")] if rates else []


def _write_if_changed(path: Path, value: str) -> None:
    """Write a cgroup file only when its value differs: a cpuset write
    takes the kernel's global cpuset lock even for the value it holds, and
    every create places its sandbox (most often on the cores it already
    has)."""
    if path.read_text().strip() != value:
        path.write_text(value)


def cpu_shares(cpu: float) -> int:
    """A sandbox's v1 weight: 1024 per core it asked for."""
    return max(2, int(1024 * cpu))


def shares_to_weight(shares: int) -> int:
    """v1 shares [2, 262144] onto v2 weight [1, 10000], as crun and runc map them."""
    return 1 + ((shares - 2) * 9999) // 262142


def _fill_cpuset(d: Path) -> None:
    """A v1 cpuset cgroup's CPUs and memory nodes from its nearest parent
    that has them (a new one has none, and nothing can join it: ENOSPC).
    Parents too: another part of the node (a VM's QEMU) may have made the
    node's own directory without them."""
    for f in ("cpuset.cpus", "cpuset.mems"):
        if (d / f).read_text().strip():
            continue
        if not (d.parent / f).read_text().strip():
            _fill_cpuset(d.parent)
        (d / f).write_text((d.parent / f).read_text())


# Generous: after a run of 10,000 containers the sweep removes 20,000
# tmpfs entries, well under a second here; a stuck rm must not hold the
# node's start for ever. Read at call time (tests patch it).
SWEEP_TIMEOUT = 120.0


async def sweep_beneath_cgroup2(nsexec: Path, parent: str) -> None:
    """Remove what crun left of this node's sandboxes beneath a hybrid
    host's cgroup2 mount before the node bound its own directory there
    (corral-nsexec --unified): a directory and a cgroup.procs file per
    container ever created, on the host's /sys/fs/cgroup tmpfs, unseen
    while the mount is over them. corral-nsexec --hybrid runs rm where
    that mount is out of the way; nothing there is live."""
    where = CGROUP_ROOT / "unified" / parent
    argv = [str(nsexec), "--hybrid", "--", "rm", "-rf", "--", str(where)]
    try:
        done = await spawn.run(argv, timeout=SWEEP_TIMEOUT)
    except TimeoutError:
        # Housekeeping only: what is left costs tmpfs memory, not isolation.
        # The node starts anyway and the next start sweeps again.
        log.warning("cgroups.sweep_timed_out", path=str(where), timeout_s=SWEEP_TIMEOUT)
        return
    if done.code != 0:
        log.warning("cgroups.sweep_failed", path=str(where), error=done.stderr.decode()[-300:])


class Cgroups:
    def __init__(self, parent: str, mode: Mode | None = None, unified: Path | None = None) -> None:
        self.parent = parent.strip("/")
        self.mode = mode or detect()
        # Hybrid only: the node's directory that corral-nsexec binds where
        # the cgroup2 mount was, so that what crun makes there (a directory
        # and a cgroup.procs file per container, plain tmpfs files: nothing
        # runs in them) lands where the node can remove it with the sandbox.
        # (Made by the node once its run tmpfs is up.)
        self.unified = unified if self.mode is Mode.HYBRID else None
        self._delegated = False  # v2: controllers enabled down to the parent
        if self.mode is Mode.V2:
            self.hierarchies = [CGROUP_ROOT]
        else:
            self.hierarchies = sorted(
                Path(mp)
                for mp, fs, _ in mounts.mount_table()
                if fs == "cgroup" and mp.startswith(str(CGROUP_ROOT))
            )
        # Where others may make a sandbox's cgroups too, to be removed with
        # it: on a hybrid host, CRIU restores into the cgroup2 mount as well.
        self.all = list(self.hierarchies)
        if self.mode is Mode.HYBRID:
            self.all += [
                Path(mp)
                for mp, fs, _ in mounts.mount_table()
                if fs == "cgroup2" and mp.startswith(str(CGROUP_ROOT))
            ]

    def oci_path(self, sandbox_id: str) -> str:
        return f"/{self.parent}/{sandbox_id}"

    def dirs(self, sandbox_id: str) -> list[Path]:
        return [h / self.parent / sandbox_id for h in self.hierarchies]

    def _controller(self, name: str) -> Path | None:
        if self.mode is Mode.V2:
            return CGROUP_ROOT
        for h in self.hierarchies:
            if name in h.name.split(","):
                return h
        return None

    def _read_int(self, controller: str, sandbox_id: str, v1: str, v2: str) -> int | None:
        base = self._controller(controller)
        if base is None:
            return None
        path = base / self.parent / sandbox_id / (v2 if self.mode is Mode.V2 else v1)
        try:
            return int(path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def thread_files(self, sandbox_id: str) -> list[Path]:
        """The files listing every thread of the sandbox (host tids): of
        its cgroup and of each below it."""
        base = self._controller("pids")
        if base is None:
            return []
        name = "cgroup.threads" if self.mode is Mode.V2 else "tasks"
        return [Path(d) / name for d, _dirs, _files in os.walk(base / self.parent / sandbox_id)]

    def set_memory(self, sandbox_id: str, limit: int) -> None:
        """Change a running sandbox's memory limit (swap stays off).

        v1 keeps memsw >= limit at every step: raising, memsw goes first;
        lowering, the limit does."""
        base = self._controller("memory")
        if base is None:
            return
        d = base / self.parent / sandbox_id
        if self.mode is Mode.V2:
            (d / "memory.max").write_text(str(limit))
            return
        mem, memsw = d / "memory.limit_in_bytes", d / "memory.memsw.limit_in_bytes"
        if not memsw.exists():
            mem.write_text(str(limit))
            return
        current = int(mem.read_text())
        order = [memsw, mem] if limit > current else [mem, memsw]
        for f in order:
            f.write_text(str(limit))

    # ------------------------------------------------------------ CPU classes

    def set_cpu_class(self, sandbox_id: str, background: bool, cpus: str, cpu: float) -> None:
        """Make the sandbox's group idle (background) or not, and confine
        it to `cpus`. An idle group yields to any non-idle sibling at once
        (cpu.idle, Linux 5.15+); where the kernel lacks it, the smallest
        weight is the nearest thing (v1 shares 2, v2 weight 1), and the
        weight of `cpu` cores (as at create) is put back."""
        d = self._dir("cpu", sandbox_id)
        if d is None:
            return
        idle = d / "cpu.idle"
        if idle.exists():
            _write_if_changed(idle, "1" if background else "0")
        else:
            shares = 2 if background else cpu_shares(cpu)
            if self.mode is Mode.V2:
                (d / "cpu.weight").write_text(str(shares_to_weight(shares)))
            else:
                (d / "cpu.shares").write_text(str(shares))
        self.set_cpuset(sandbox_id, cpus)

    def cpu_idle(self, sandbox_id: str) -> bool | None:
        """Whether the sandbox's group is idle now (None: no such group)."""
        d = self._dir("cpu", sandbox_id)
        try:
            return (d / "cpu.idle").read_text().strip() == "1"  # type: ignore[operator]
        except (OSError, TypeError):
            return None

    def set_cpuset(self, sandbox_id: str, cpus: str) -> None:
        d = self._dir("cpuset", sandbox_id)
        if d is not None and (d / "cpuset.cpus").exists():
            _write_if_changed(d / "cpuset.cpus", cpus)

    def set_limits(
        self, sandbox_id: str, *, cpu: float, memory: int, pids: int, period: int
    ) -> None:
        """A running sandbox's CPU, memory and pids ceilings, changed as
        create() writes them (a claimed warm sandbox takes its claimant's)."""
        self.set_memory(sandbox_id, memory)
        quota = str(int(cpu * period))
        if self.mode is Mode.V2:
            writes = [("", "cpu.max", f"{quota} {period}"), ("", "pids.max", str(pids))]
        else:
            writes = [("cpu", "cpu.cfs_quota_us", quota), ("pids", "pids.max", str(pids))]
            if not self.cpu_idle(sandbox_id):  # an idle group's shares are the kernel's
                writes.append(("cpu", "cpu.shares", str(cpu_shares(cpu))))
        for controller, name, value in writes:
            base = CGROUP_ROOT if self.mode is Mode.V2 else self._controller(controller)
            if base is not None:
                (base / self.parent / sandbox_id / name).write_text(value)

    def memory_usage(self, sandbox_id: str) -> int | None:
        return self._read_int("memory", sandbox_id, "memory.usage_in_bytes", "memory.current")

    def cpu_seconds(self, sandbox_id: str) -> float | None:
        """CPU time (user + system) its processes used, all of them."""
        if self.mode is Mode.V2:
            try:
                text = (CGROUP_ROOT / self.parent / sandbox_id / "cpu.stat").read_text()
            except OSError:
                return None
            for line in text.splitlines():
                key, _, value = line.partition(" ")
                if key == "usage_usec":
                    return int(value) / 1e6
            return None
        ns = self._read_int("cpuacct", sandbox_id, "cpuacct.usage", "")
        return None if ns is None else ns / 1e9

    def procs(self, sandbox_id: str) -> list[int]:
        """Host pids of every process of the sandbox (its cgroup and below)."""
        base = self._controller("pids")
        if base is None:
            return []
        out: list[int] = []
        for d, _dirs, _files in os.walk(base / self.parent / sandbox_id):
            try:
                out += [int(x) for x in (Path(d) / "cgroup.procs").read_text().split()]
            except (OSError, ValueError):
                continue
        return out

    def memory_peak(self, sandbox_id: str) -> int | None:
        return self._read_int("memory", sandbox_id, "memory.max_usage_in_bytes", "memory.peak")

    def pids(self, sandbox_id: str) -> int | None:
        return self._read_int("pids", sandbox_id, "pids.current", "pids.current")

    def oom_kills(self, sandbox_id: str) -> int:
        base = self._controller("memory")
        if base is None:
            return 0
        name = "memory.events" if self.mode is Mode.V2 else "memory.oom_control"
        try:
            for line in (base / self.parent / sandbox_id / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except OSError:
            pass
        return 0

    def pids_limit_hits(self, sandbox_id: str) -> int:
        """How many forks the pids limit refused."""
        base = self._controller("pids")
        if base is None:
            return 0
        try:
            for line in (base / self.parent / sandbox_id / "pids.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "max":
                    return int(value)
        except OSError:
            pass
        return 0

    # ------------------------------------------------------------ making

    # What crun allows a container (OCI's default devices): the rest is denied.
    # ("m" for all: making a node is the user namespace's to refuse, and
    # overlay whiteouts are 0:0 character devices.)
    _DEVICES = ("c *:* m", "b *:* m", "c 1:3 rwm", "c 1:5 rwm", "c 1:7 rwm", "c 1:8 rwm",
                "c 1:9 rwm", "c 5:0 rwm", "c 5:1 rwm", "c 5:2 rwm", "c 136:* rwm")  # fmt: skip

    def create(
        self,
        sandbox_id: str,
        *,
        cpu: float,
        memory: int,
        pids: int,
        period: int,
        io: IoLimit | None = None,
    ) -> None:
        """Make a sandbox's cgroups with its limits, as crun would at
        create: for a restored checkpoint, which crun never started. Every
        limit crun writes from the bundle is written here too (a copy that
        missed one would be a sandbox with a ceiling lifted)."""
        self.make_dirs(sandbox_id)
        limits: dict[str, list[tuple[str, str]]]
        if self.mode is Mode.V2:
            limits = {"": [("memory.max", str(memory)), ("memory.swap.max", "0"),
                           ("cpu.max", f"{int(cpu * period)} {period}"),
                           ("pids.max", str(pids)), *(io.v2() if io else [])]}  # fmt: skip
        else:
            limits = {
                "memory": [("memory.limit_in_bytes", str(memory)),
                           ("memory.memsw.limit_in_bytes", str(memory)),
                           ("memory.swappiness", "0")],
                "cpu": [("cpu.cfs_period_us", str(period)),
                        ("cpu.cfs_quota_us", str(int(cpu * period))),
                        ("cpu.shares", str(cpu_shares(cpu)))],
                "pids": [("pids.max", str(pids))],
                "devices": [("devices.deny", "a"), *(("devices.allow", r) for r in self._DEVICES)],
                "blkio": io.v1() if io else [],
            }  # fmt: skip
        for controller, writes in limits.items():
            base = CGROUP_ROOT if self.mode is Mode.V2 else self._controller(controller)
            if base is None:
                continue
            for name, value in writes:
                try:
                    fd = os.open(base / self.parent / sandbox_id / name, os.O_WRONLY)
                except FileNotFoundError:
                    if name in _OPTIONAL:
                        continue
                    # A limit with no file is a sandbox without that ceiling.
                    raise Unavailable(
                        f"cgroup {base / self.parent / sandbox_id} has no {name}: its "
                        f"controller is not enabled for it ({self._why_missing(name)})"
                    ) from None
                try:
                    os.write(fd, value.encode())
                finally:
                    os.close(fd)

    def make_dirs(self, sandbox_id: str) -> None:
        """The sandbox's cgroup directories, one a hierarchy, each with what
        it needs before a process joins: on v2 its controllers (delegate),
        on v1 a cpuset's cpus and memory nodes."""
        if self.mode is Mode.V2 and not self._delegated:
            self.delegate()
        for h in self.hierarchies:
            # Every create with corral-run comes here (oci.py): the node's
            # own directories are made once, then one mkdir a hierarchy.
            try:
                os.mkdir(h / self.parent / sandbox_id)
                made = [h / self.parent / sandbox_id]
            except FileExistsError:
                made = []
            except FileNotFoundError:
                if self.mode is Mode.V2:
                    # The parent went (a node removes it when it holds no
                    # sandbox, maybe another agent of it): made again with
                    # its controllers.
                    self.delegate()
                    os.mkdir(h / self.parent / sandbox_id)
                    continue
                made = []
                d = h
                for part in [*self.parent.split("/"), sandbox_id]:
                    d = d / part
                    if not d.is_dir():
                        d.mkdir()
                        made.append(d)
            if "cpuset" in h.name.split(","):  # v1: empty until inherited
                for d in made:
                    _fill_cpuset(d)

    def delegate(self) -> None:
        """v2: a cgroup has a controller's files only where its parent
        enables the controller (cgroup.subtree_control), and so on up to the
        root. Enable every controller a sandbox is limited by, from the root
        down to our parent, making the parent's directories. Required ones
        the root does not offer are refused here, before any sandbox runs
        without its ceiling."""
        d = CGROUP_ROOT
        for part in ["", *self.parent.split("/")]:
            d = d / part if part else d
            d.mkdir(exist_ok=True)
            offered = set((d / "cgroup.controllers").read_text().split())
            absent = [c for c in _V2_REQUIRED if c not in offered]
            if absent:
                raise Unavailable(
                    f"cgroup v2: {d} is not offered the {', '.join(absent)} controller(s) "
                    f"a sandbox's limits need (cgroup.controllers: {' '.join(sorted(offered))}; "
                    "a systemd host: run the node with Delegate=yes or as root of the tree)"
                )
            enabled = set((d / "cgroup.subtree_control").read_text().split())
            wanted = [c for c in (*_V2_REQUIRED, *_V2_OPTIONAL) if c in offered - enabled]
            if wanted:
                (d / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in wanted))
        self._delegated = True

    def _why_missing(self, name: str) -> str:
        if self.mode is not Mode.V2:
            return f"is the {name.split('.')[0]} hierarchy mounted?"
        parent = CGROUP_ROOT / self.parent
        try:
            enabled = (parent / "cgroup.subtree_control").read_text().split()
        except OSError as e:
            return f"{parent}: {e.strerror}"
        return f"{parent}/cgroup.subtree_control enables: {' '.join(enabled) or 'nothing'}"

    # ------------------------------------------------------------ freezing

    def _dir(self, controller: str, sandbox_id: str) -> Path | None:
        base = self._controller(controller)
        return None if base is None else base / self.parent / sandbox_id

    async def freeze(self, sandbox_id: str, timeout: float = 5.0) -> None:
        """Stop every process of the sandbox where it stands (they do not
        see it: no signal, no EINTR) and return once all are stopped."""
        await self._set_frozen(sandbox_id, True, timeout)

    async def thaw(self, sandbox_id: str, timeout: float = 5.0) -> None:
        await self._set_frozen(sandbox_id, False, timeout)

    def freezer_dir(self, sandbox_id: str) -> Path | None:
        """The cgroup directory whose freezer holds the sandbox."""
        return self._dir("freezer", sandbox_id)

    def frozen(self, sandbox_id: str) -> bool:
        d = self._dir("freezer", sandbox_id)
        try:
            if self.mode is Mode.V2:
                return "frozen 1" in (d / "cgroup.events").read_text().splitlines()  # type: ignore[operator]
            return (d / "freezer.state").read_text().strip() == "FROZEN"  # type: ignore[operator]
        except (OSError, TypeError):
            return False

    async def _set_frozen(self, sandbox_id: str, frozen: bool, timeout: float) -> None:
        d = self._dir("freezer", sandbox_id)
        if d is None:
            raise OSError("this host has no cgroup freezer")
        if self.mode is Mode.V2:
            (d / "cgroup.freeze").write_text("1" if frozen else "0")
        else:
            (d / "freezer.state").write_text("FROZEN" if frozen else "THAWED")
        # Freezing is asynchronous (v1 reads FREEZING, v2's events lag):
        # a task in an uninterruptible sleep stops only when it wakes.
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while self.frozen(sandbox_id) != frozen:
            if time.monotonic() > deadline:
                what = "freeze" if frozen else "thaw"
                raise TimeoutError(f"the cgroup of {sandbox_id} did not {what} in {timeout:g} s")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.02)

    def reclaim(self, sandbox_id: str) -> int:
        """Push a (frozen) sandbox's memory out: its page cache is dropped
        and its anonymous memory goes to swap where the host has some.
        Returns the bytes its usage fell by. Swap stays off while the
        sandbox runs (swap_off_while_running); only this call swaps it."""
        d = self._dir("memory", sandbox_id)
        before = self.memory_usage(sandbox_id)
        if d is None or before is None:
            return 0
        try:
            if self.mode is Mode.V2:
                # swap.max is 0 while it runs (memory+swap == memory).
                (d / "memory.swap.max").write_text("max")
                with contextlib.suppress(OSError):  # EAGAIN: reclaimed less than asked
                    (d / "memory.reclaim").write_text(str(before))
                (d / "memory.swap.max").write_text("0")
            else:
                (d / "memory.swappiness").write_text("100")
                # v1's only "reclaim now": it retries until usage is 0 or
                # reclaim makes no progress; tasks may stay in the cgroup.
                (d / "memory.force_empty").write_text("0")
                (d / "memory.swappiness").write_text("0")
        except OSError:
            return 0
        after = self.memory_usage(sandbox_id) or 0
        return max(0, before - after)

    def present(self) -> set[str]:
        """Sandbox ids that have a cgroup under our parent in any hierarchy."""
        out: set[str] = set()
        for h in [*self.all, *([self.unified] if self.unified else [])]:
            try:
                out.update(p.name for p in (h / self.parent).iterdir() if p.is_dir())
            except OSError:
                continue
        return out

    def remove(self, sandbox_id: str, timeout: float = 5.0) -> None:
        """Kill what is left inside and rmdir every directory of the sandbox.

        Every close comes here, so the common cases cost one syscall per
        hierarchy: a removed cgroup's rmdir answers ENOENT, an empty one's
        succeeds. Only a cgroup that refuses (tasks, or child cgroups: a
        checkpoint restored as this sandbox keeps its tasks under the path
        it was dumped from, below this one, criu --cgroup-root) is walked,
        by directory entry type (no stat per control file), its tasks
        killed and its children removed first."""
        deadline = time.monotonic() + timeout
        nap = 0.001
        thawed = False
        for d in [h / self.parent / sandbox_id for h in self.all]:
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                freezer = self._dir("freezer", sandbox_id)
                if not thawed and freezer is not None and self.mode is not Mode.V2:
                    thawed = True  # a frozen task takes its SIGKILL only once thawed (v1)
                    with contextlib.suppress(OSError):
                        (freezer / "freezer.state").write_text("THAWED")
                tree = [Path(top) for top, _dirs, _files in os.walk(d, topdown=False)]
                for cg in tree:
                    with contextlib.suppress(OSError, ValueError):
                        for pid in (cg / "cgroup.procs").read_text().split():
                            with contextlib.suppress(ProcessLookupError):
                                os.kill(int(pid), 9)
                for cg in tree[:-1]:
                    with contextlib.suppress(OSError):
                        os.rmdir(cg)
                time.sleep(nap)  # the killed tasks' exit is asynchronous
                nap = min(nap * 2, 0.01)
        if self.unified is not None:  # never read for pids: crun wrote them, the sandbox is gone
            d = self.unified / self.parent / sandbox_id
            try:  # what crun makes there, in two syscalls
                os.unlink(d / "cgroup.procs")
                os.rmdir(d)
            except OSError:
                shutil.rmtree(d, ignore_errors=True)

    def remove_parent(self) -> None:
        """Remove our (empty) parent cgroups, e.g. when the node has no sandbox."""
        self._delegated = False
        for h in [*self.all, *([self.unified] if self.unified else [])]:
            parts = self.parent.split("/")
            for depth in range(len(parts), 0, -1):
                try:
                    (h / "/".join(parts[:depth])).rmdir()
                except OSError:
                    break
