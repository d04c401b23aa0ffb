"""What the node agent needs from a sandbox backend.

The agent owns records, admission, layers and scratch space; a runtime turns
a prepared sandbox into something running that serves the exec protocol at
a control path, and releases what it made. Every resource a runtime will
create is declared by ``resources()`` and recorded *before* start() makes
it (see node/store.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from corral.node.store import SandboxRecord


@dataclass(frozen=True)
class Prepared:
    """What the agent has made ready before the runtime starts."""

    lower: list[Path]  # mounted layer roots, topmost first
    upper: Path
    work: Path
    sandbox_dir: Path
    control: Path  # where the exec server must listen
    env: list[str]
    host_id: int | None = None  # first host uid/gid of the sandbox's user namespace


@dataclass(frozen=True)
class Started:
    pid: int
    pid_start: int


class Runtime(Protocol):
    kind: str

    def resources(self, sandbox_id: str, prep: Prepared) -> list[tuple[str, str]]:
        """(kind, ref) of everything start() may create, for the record."""
        ...

    async def start(self, rec: SandboxRecord, prep: Prepared) -> Started: ...

    async def release(self, kind: str, ref: str) -> bool:
        """Release a resource this runtime owns; False if the kind is not its."""
        ...


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat: tells a process from a later one
    that reused its pid. None if there is no such process, or only its
    zombie (it has exited; its parent has not collected it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])
