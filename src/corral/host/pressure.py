"""What the host says of its own load: pressure stall information (PSI)
and free memory, read from /proc.

PSI's `avg10` is the share of the last ten seconds in which some task
(`some`) or every non-idle task (`full`) was stalled waiting for the
resource: a node whose tasks wait is a node whose sandboxes are already
slower than they were promised, whatever their limits add up to.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PRESSURE = Path("/proc/pressure")
MEMINFO = Path("/proc/meminfo")
RESOURCES = ("cpu", "memory", "io")


@dataclass(frozen=True)
class Stall:
    some: float  # percent of the last 10 s
    full: float


def parse(text: str) -> Stall:
    """One /proc/pressure file: 'some avg10=1.23 ...\\nfull avg10=0.00 ...'."""
    avg = {"some": 0.0, "full": 0.0}
    for line in text.splitlines():
        kind, *fields = line.split()
        for f in fields:
            key, _, value = f.partition("=")
            if key == "avg10" and kind in avg:
                avg[kind] = float(value)
    return Stall(avg["some"], avg["full"])


def read(root: Path = PRESSURE) -> dict[str, Stall]:
    """Per resource; empty where the kernel has no PSI."""
    out: dict[str, Stall] = {}
    for res in RESOURCES:
        try:
            out[res] = parse((root / res).read_text())
        except (OSError, ValueError):
            continue
    return out


def mem_available(meminfo: Path = MEMINFO) -> int | None:
    """Bytes the kernel could give without swapping (MemAvailable)."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
