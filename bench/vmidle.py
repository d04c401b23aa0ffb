"""What an idle microVM costs the host in CPU, with the quiet idle guest
(`vm_quiet_idle`: no PIT under TCG, the guest kernel's watchdog, pressure
averaging, per-second statistics and proactive compaction off) and,
side by side in the same run, without it (QEMU's and the guest kernel's
defaults). Under TCG every guest timer is emulated: this, not memory, is
what ended the idle-microVM density record (bench/results/vmdensity.md).

    python bench/vmidle.py [--vms 8] [--rounds 2] [--window 60] [--memory 256MiB,1GiB]

Each round boots --vms microVMs (debian-python) per guest memory size and
mode, runs
one Python command in each, lets them settle 20 s, then measures over
--window seconds: each QEMU's own CPU (utime + stime, as a share of one
core), the whole host's busy share, and, in two sampled guests, their
timer interrupts per second (/proc/interrupts LOC, read before and after
the window). Then `true` in each VM, one after another. Modes alternate
(off, on, off, on, ...), on one node data dir per mode. 256 MiB is what
the density record gives each VM; 1 GiB is a microVM's default.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corral
from _common import (
    IMAGE,
    IMAGES,
    fresh_dir,
    host_busy,
    leak_counts,
    median,
    pct,
    table,
    write_result,
)
from corral.config import NodeConfig
from corral.runtimes.vm.qemu import IDLE_CMDLINE, accelerator

WORK = Path("/var/lib/corral-vmidle")
SETTLE = 20.0
HZ = os.sysconf("SC_CLK_TCK")


def qemu_ticks(data_dir: Path) -> dict[int, int]:
    """utime + stime (clock ticks) of each QEMU whose sandbox lives under
    `data_dir`."""
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes()
            if b"qemu-system" not in cmd or str(data_dir).encode() not in cmd:
                continue
            f = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            out[int(p)] = int(f[11]) + int(f[12])
        except OSError:
            continue
    return out


async def local_timer(s: corral.AsyncSandbox) -> int:
    r = await s.commands.run(["sh", "-c", "grep LOC: /proc/interrupts"])
    return int(r.stdout.split()[1])


async def round_(quiet: bool, memory: str, vms: int, window: float) -> list[float]:
    """[QEMU CPU per VM median %, p99 %, host busy %, guest LOC/s, exec p50, exec p99]."""
    mode = "on" if quiet else "off"
    cfg = NodeConfig.from_env(
        data_dir=WORK / mode, images=IMAGES, node="vmi", scratch_size=8 * 2**30,
        memory_overcommit=8.0, vm_quiet_idle=quiet,
    )  # fmt: skip
    fresh_dir(cfg.data_dir)
    boxes: list[corral.AsyncSandbox] = []
    async with corral.AsyncClient(config=cfg) as c:
        sem = asyncio.Semaphore(2)  # TCG boots are CPU: two at a time on two cores

        async def one() -> None:
            async with sem:
                s = await c.sandboxes.create(
                    kind="microvm", image=IMAGE, memory=memory, idle_timeout=None
                )
                boxes.append(s)
                await s.commands.run("python3 -c 'import json, email, http.client'")

        try:
            await asyncio.gather(*(one() for _ in range(vms)))
            await asyncio.sleep(SETTLE)
            sample = boxes[:2]
            loc0 = [await local_timer(s) for s in sample]
            a, b0, t0 = qemu_ticks(cfg.data_dir), host_busy(), time.monotonic()
            await asyncio.sleep(window)
            b, b1, dt = qemu_ticks(cfg.data_dir), host_busy(), time.monotonic() - t0
            loc1 = [await local_timer(s) for s in sample]
            per_vm = [100 * (b[p] - a[p]) / HZ / dt for p in b if p in a]
            busy = 100 * (b1 - b0) / dt / (os.cpu_count() or 1)
            loc = median([(y - x) / dt for x, y in zip(loc0, loc1, strict=True)])
            lat = []
            for s in boxes:
                t = time.perf_counter()
                await s.commands.run(["true"])
                lat.append((time.perf_counter() - t) * 1000)
        finally:
            await asyncio.gather(*(s.close() for s in boxes), return_exceptions=True)
    assert len(per_vm) == vms, f"{len(per_vm)} QEMUs measured of {vms}"
    row = [median(per_vm), pct(per_vm, 99), busy, loc, pct(lat, 50), pct(lat, 99)]
    print(memory, mode, [f"{v:.2f}" for v in row], flush=True)
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vms", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--window", type=float, default=60.0, help="seconds measured")
    p.add_argument("--memory", default="256MiB,1GiB", help="guest memory sizes, comma-separated")
    a = p.parse_args()
    sizes = a.memory.split(",")
    if a.vms < 2 or a.rounds < 1 or a.window < 10:
        p.error("--vms >= 2, --rounds >= 1, --window >= 10")
    before = leak_counts(WORK)
    rows: dict[tuple[str, bool], list[list[float]]] = {}
    for _ in range(a.rounds):
        for size in sizes:
            for quiet in (False, True):
                row = asyncio.run(round_(quiet, size, a.vms, a.window))
                rows.setdefault((size, quiet), []).append(row)
    after = leak_counts(WORK)

    def fmt(size: str, quiet: bool, i: int, r: list[float]) -> list[str]:
        label = "quiet idle guest (vm_quiet_idle)" if quiet else "QEMU's and the kernel's defaults"
        return [size, label, str(i + 1), f"{r[0]:.2f}%", f"{r[1]:.2f}%", f"{r[2]:.1f}%",
                f"{r[3]:.1f}", f"{100 / r[0]:.0f}" if r[0] > 0 else "-",
                f"{r[4]:.0f}", f"{r[5]:.0f}"]  # fmt: skip

    body = [
        fmt(size, q, i, rows[size, q][i])
        for size in sizes
        for i in range(a.rounds)
        for q in (False, True)
    ]
    summary = []
    for size in sizes:
        off = median([r[0] for r in rows[size, False]])
        on = median([r[0] for r in rows[size, True]])
        if on > 0:
            summary.append(
                f"{size}: **{off:.2f}%** of a core per idle VM with the defaults, "
                f"**{on:.2f}%** quiet ({off / on:.1f}x less)"
            )
    header = ["guest memory", "guest", "round", "QEMU CPU per idle VM (median, % of a core)",
              "p99 of VMs",
              "host busy (all cores)", "guest timer interrupts /s", "idle VMs per core",
              "exec `true` p50 (ms)", "exec p99 (ms)"]  # fmt: skip
    sections = [
        f"{a.vms} microVMs ({accelerator()}) per round, size and mode, debian-python, "
        "no reclaim; each ran `python3 -c 'import json, email, http.client'` once, then "
        f"idled {SETTLE:.0f} s before a {a.window:.0f} s window. QEMU CPU is each VM's "
        "emulator process (utime + stime) over the window, as a share of one core; host busy "
        "is the whole machine's; guest timer interrupts are LOC in two sampled guests. Idle "
        "VMs per core is 100 / the median. Quiet: `-M microvm,pit=off` and "
        f"`{IDLE_CMDLINE}` on the guest's command line (runtimes/vm/qemu.py).",
        table(header, body),
        "Median over rounds: " + "; ".join(summary) + ".",
        "## Leftovers (host-wide, before the run vs after)\n\n"
        + table(
            ["object", "before", "after"], [[k, str(before[k]), str(after[k])] for k in before]
        ),
    ]
    write_result("vmidle", "CPU of an idle microVM", [s for s in sections if s])


if __name__ == "__main__":
    main()
