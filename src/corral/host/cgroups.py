"""Where a sandbox's cgroups live, what they report, and how to remove them.

The OCI runtime creates and fills the cgroups (it writes the limits from the
bundle); this module only names them, reads them and reclaims leftovers.
Supports cgroup v1 (these development hosts: controllers under
/sys/fs/cgroup/<controller>, plus a cgroup2 mount at /sys/fs/cgroup/unified
that makes crun refuse to run unless it is hidden) and pure cgroup v2
(production hosts).
"""

from __future__ import annotations

import os
import time
from enum import StrEnum
from pathlib import Path

from corral.host import mounts

CGROUP_ROOT = Path("/sys/fs/cgroup")


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


class Cgroups:
    def __init__(self, parent: str, mode: Mode | None = None) -> None:
        self.parent = parent.strip("/")
        self.mode = mode or detect()
        if self.mode is Mode.V2:
            self.hierarchies = [CGROUP_ROOT]
        else:
            self.hierarchies = sorted(
                Path(mp)
                for mp, fs, _ in mounts.mount_table()
                if fs == "cgroup" and mp.startswith(str(CGROUP_ROOT))
            )

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

    def memory_usage(self, sandbox_id: str) -> int | None:
        return self._read_int("memory", sandbox_id, "memory.usage_in_bytes", "memory.current")

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

    def present(self) -> set[str]:
        """Sandbox ids that have a cgroup under our parent in any hierarchy."""
        out: set[str] = set()
        for h in self.hierarchies:
            try:
                out.update(p.name for p in (h / self.parent).iterdir() if p.is_dir())
            except OSError:
                continue
        return out

    def remove(self, sandbox_id: str, timeout: float = 5.0) -> None:
        """Kill what is left inside and rmdir every directory of the sandbox."""
        deadline = time.monotonic() + timeout
        for d in self.dirs(sandbox_id):
            while d.exists():
                try:
                    for pid in (d / "cgroup.procs").read_text().split():
                        try:
                            os.kill(int(pid), 9)
                        except ProcessLookupError:
                            pass
                    for child in d.iterdir():
                        if child.is_dir():
                            child.rmdir()
                    d.rmdir()
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)

    def remove_parent(self) -> None:
        """Remove our (empty) parent cgroups, e.g. when the node has no sandbox."""
        for h in self.hierarchies:
            parts = self.parent.split("/")
            for depth in range(len(parts), 0, -1):
                try:
                    (h / "/".join(parts[:depth])).rmdir()
                except OSError:
                    break
