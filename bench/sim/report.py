"""The tables of bench/cellsim.py: what one phase of a simulated cell
measured (Load, Measured) and how it is written down."""

from __future__ import annotations

import collections
import os
import platform
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from _common import pct, table

NCPU = os.cpu_count() or 1
PARTS = ("postgres", "gateways", "simnodes", "loadgen")


@dataclass
class Load:
    offered: int
    ids: list[str] = field(default_factory=list)
    lat: list[float] = field(default_factory=list)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    shed: int = 0
    retries: int = 0
    cut_off: int = 0
    wall: float = 0.0
    why: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass
class Measured:
    load: Load
    wall: float
    cpu: dict[str, float]
    machine: float
    commits: int
    statements: list[list[str]]
    waits: collections.Counter[str]
    samples: int
    calls: dict[str, int]
    deadlocks: int


def busiest(m: Measured) -> str:
    """Which part is CPU-bound: a one-process part near its one core, or the
    machine near all of its cores."""
    w = m.wall
    share = {k: v / w for k, v in m.cpu.items() if k not in ("gateways",)}
    single = {k: v for k, v in share.items() if k.startswith(("gateway", "simnodes", "loadgen"))}
    top = max(single, key=lambda k: single[k])
    machine = m.machine / w / NCPU
    parts = f"{top} {single[top]:.2f} core, postgres {share['postgres']:.2f} cores"
    if single[top] >= 0.85:
        return f"{top} CPU-bound ({parts}; machine {machine:.0%})"
    if machine >= 0.9:
        return f"machine saturated ({machine:.0%} of {NCPU} cores; {parts})"
    return f"nothing CPU-bound ({parts}; machine {machine:.0%}): waits"


def row(gateways: int, phase: str, m: Measured) -> list[str]:
    ld, w = m.load, m.wall
    ok = len(ld.ids)
    errs = ", ".join(f"{k} {v}" for k, v in sorted(ld.errors.items())) or "0"
    return [
        str(gateways),
        phase,
        f"{ld.offered:,}",
        f"{ok:,}",
        errs
        + (f"; shed {ld.shed:,}" if ld.shed else "")
        + (f"; cut {ld.cut_off}" if ld.cut_off else ""),
        f"{w:.1f}",
        f"{ok / w:.0f}",
        f"{ok / w / gateways:.0f}",
        f"{pct(ld.lat, 50) * 1000:.0f}" if ok else "-",
        f"{pct(ld.lat, 99) * 1000:.0f}" if ok else "-",
        str(m.deadlocks),
        busiest(m),
    ]


def cpu_row(gateways: int, phase: str, m: Measured, idle: dict[str, float]) -> list[str]:
    """CPU seconds by part; with the cell's idle load (CPU seconds per
    second of each part: heartbeats, sweeps) taken out, per create."""
    ok, w = len(m.load.ids), m.wall
    other = m.machine - sum(m.cpu[k] for k in PARTS)
    marginal = {k: (m.cpu[k] - idle.get(k, 0.0) * w) / ok * 1000 if ok else 0.0 for k in PARTS}
    cores = " / ".join(f"{m.cpu[k] / w:.2f}" for k in PARTS)
    return [
        str(gateways),
        phase,
        " / ".join(f"{m.cpu[k]:.1f}" for k in PARTS) + f" / {max(other, 0):.1f}",
        cores,
        " / ".join(f"{max(marginal[k], 0):.1f}" for k in PARTS) if ok else "-",
        f"{ok / m.cpu['postgres']:.0f}" if ok else "-",
        f"{ok / m.cpu['gateways']:.0f}" if ok else "-",
        f"{m.commits / w:.0f}",
        f"{m.commits / ok:.1f}" if ok else "-",
    ]


def waits_line(m: Measured) -> str:
    if not m.samples:
        return "-"
    top = m.waits.most_common(4)
    return ", ".join(f"{k} {v / m.samples:.1f}" for k, v in top) or "none busy"


def calls_line(m: Measured) -> str:
    return ", ".join(f"{k} {v:,}" for k, v in sorted(m.calls.items()))


def statements_section(entries: list[tuple[int, str, Measured]]) -> str:
    """The heaviest statements: per second while idle, per create otherwise."""
    out = []
    for gateways, phase, m in entries:
        ok = len(m.load.ids)
        per, unit = (ok, "create") if ok else (m.wall, "second")
        if not m.statements or not per:
            continue
        rows = [
            [f"{int(c) / per:.2f}", f"{float(t) / per:.3f}", q[:160].replace("|", "\\|")]
            for c, t, q in m.statements
        ]
        out.append(
            f"{gateways} gateway(s), {phase}:\n\n"
            + table([f"calls per {unit}", f"exec ms per {unit}", "statement"], rows)
        )
    return "\n\n".join(out)


def versions() -> str:
    def v(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    pg = sorted(p.name for p in Path("/usr/lib/postgresql").iterdir())[-1]
    mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    return (
        f"`nproc` {NCPU}, {mem:.0f} GiB memory, kernel {platform.release()}; "
        f"PostgreSQL {pg} (synchronous_commit on), Python {platform.python_version()}, "
        f"corral {v('corral')}, uvicorn {v('uvicorn')}, httpx {v('httpx')}, "
        f"psycopg {v('psycopg')}, uvloop {v('uvloop')}, pydantic {v('pydantic')}"
    )
