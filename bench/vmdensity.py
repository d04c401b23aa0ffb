"""Idle microVMs held at once, and host memory per idle VM, with the node's
memory savers on (a bounded TCG code cache, free page reporting, idle
reclaim to a swap file, through zswap or straight to the file, a quiet
idle guest: no PIT, the guest kernel's periodic work off) and, side by side
in the same run, with QEMU's and the guest kernel's defaults (a 1 GiB code
cache, no reclaim, a PIT ticking, the kernel's timers as they come). One
savers mode (--long) holds as many VMs as it can, up to --max; the others
hold --baseline.

    python bench/vmdensity.py [--long swap] [--max 400] [--baseline 8]
        [--deadline 30] [--exec-limit 2000] [--swap-gib 32]

The long run stops at the first of: the node refusing a create (memory
or pids: its reason is recorded), the sampled exec p99 above --exec-limit
ms (idle TCG guests are not free: each one's timer ticks are emulated, so
CPU, not memory, may be what runs out first), --deadline, --max.

Each VM (256 MiB, debian-python) runs one Python command after its boot,
then idles. Host memory is MemTotal - MemAvailable less before the VMs,
per VM, 15 s after each checkpoint (the zswap pool counts: it is host
memory); the cgroup figure is what the kernel charges the VMs' QEMUs;
swap is what went to the swap file (disk, not memory); host CPU is the
whole machine's busy share over those 15 s.
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
    mem_used,
    meminfo,
    pct,
    table,
    unless_full,
    write_result,
)
from corral.config import NodeConfig
from corral.host import swap
from corral.node.agent import NodeAgent
from corral.runtimes.vm.qemu import accelerator

WORK = Path("/var/lib/corral-vmdensity")
SETTLE = 15.0
RECLAIM_AFTER = 5.0


LABELS = {
    "defaults": "QEMU defaults, no reclaim",
    "zswap": "savers on, swap through zswap",
    "swap": "savers on, swap file without zswap",
}


CHECKPOINTS = (4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)


def swap_used() -> int:
    return meminfo("SwapTotal") - meminfo("SwapFree")


async def hold(
    mode: str, maximum: int, deadline: float, exec_limit: float, swap_gib: int
) -> tuple[list[list[str]], str]:
    """Rows per checkpoint, and what stopped the run."""
    savers = mode != "defaults"
    cfg = NodeConfig.from_env(
        data_dir=WORK / mode, images=IMAGES, node="vmd",
        scratch_size=16 * 2**30, swap_size=swap_gib * 2**30, memory_overcommit=64.0,
        reclaim_after=RECLAIM_AFTER if savers else 0.0, reaper_interval=0.5,
        vm_tcg_cache_mib=NodeConfig().vm_tcg_cache_mib if savers else 0,
        vm_quiet_idle=savers,
        zswap=mode == "zswap",
    )  # fmt: skip
    fresh_dir(cfg.data_dir)
    label = LABELS[mode]
    steps = [n for n in CHECKPOINTS if n < maximum] + [maximum]
    rows: list[list[str]] = []
    stopped = f"none: the run's --max ({maximum}) was reached"
    boxes: list[corral.AsyncSandbox] = []
    async with corral.AsyncClient(config=cfg) as c:
        if savers and not swap.active(cfg.data_dir / "swap"):
            raise SystemExit("the host refused a swap file: nothing to reclaim to")
        agent = c.service
        assert isinstance(agent, NodeAgent)
        cgroups = agent.parts.cgroups
        base, swap_base = mem_used(), swap_used()
        t0 = time.monotonic()
        sem = asyncio.Semaphore(2)  # TCG boots are CPU: two at a time on two cores
        refused: list[str] = []

        async def one() -> None:
            async with sem:
                s = await unless_full(
                    lambda: c.sandboxes.create(
                        kind="microvm", image=IMAGE, memory="256MiB", idle_timeout=None
                    ),
                    refused,
                )
                if s is None:
                    return
                boxes.append(s)  # closed by the run whatever happens next
                try:
                    await s.commands.run("python3 -c 'import json, email, http.client'")
                except corral.CommandTimeout as exc:
                    # Held VMs' idle guests took the host's CPU: the record's end.
                    refused.append(f"CPU: a new VM's first command did not finish ({exc})")

        try:
            for cp in steps:
                await asyncio.gather(*(one() for _ in range(cp - len(boxes))))
                if not boxes:
                    raise SystemExit(refused[0] if refused else "no VM started")
                busy0, at0 = host_busy(), time.monotonic()
                await asyncio.sleep(SETTLE)
                cpu = (host_busy() - busy0) / (time.monotonic() - at0) / (os.cpu_count() or 1)
                n = len(boxes)
                host = (mem_used() - base) / n / 2**20
                swapped = (swap_used() - swap_base) / n / 2**20
                cg = sum(cgroups.memory_usage(b.id) or 0 for b in boxes) / n / 2**20
                lat = []
                for s in boxes[:: max(1, n // 8)]:
                    t = time.perf_counter()
                    await s.commands.run(["true"])
                    lat.append((time.perf_counter() - t) * 1000)
                rows.append([label, str(n), f"{host:.0f}", f"{cg:.0f}", f"{swapped:.0f}",
                             f"{cpu:.0%}", f"{pct(lat, 50):.0f}",
                             f"{pct(lat, 99):.0f}"])  # fmt: skip
                print(rows[-1], flush=True)
                if refused:
                    stopped = refused[0]
                    break
                if pct(lat, 99) > exec_limit:
                    stopped = (
                        f"CPU: at {n} VMs the host was {cpu:.0%} busy with idle TCG guests and "
                        f"the sampled exec p99 ({pct(lat, 99):.0f} ms) passed --exec-limit "
                        f"({exec_limit:.0f} ms)"
                    )
                    break
                if time.monotonic() - t0 > deadline and cp < maximum:
                    stopped = f"the run's deadline ({deadline / 60:.0f} min) at {n} VMs"
                    break
        finally:
            await asyncio.gather(*(s.close() for s in boxes), return_exceptions=True)
    return rows, stopped


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--long", choices=["swap", "zswap"], default="swap",
                   help="the savers mode that holds up to --max")  # fmt: skip
    p.add_argument("--max", type=int, default=400)
    p.add_argument("--baseline", type=int, default=8, help="VMs held in the other two modes")
    p.add_argument("--deadline", type=float, default=30.0, help="minutes of creating")
    p.add_argument("--exec-limit", type=float, default=2000.0, help="stop above this exec p99, ms")
    p.add_argument("--swap-gib", type=int, default=32, help="the node's swap file")
    a = p.parse_args()
    if not 1 <= a.baseline <= a.max:
        p.error(f"--baseline must be 1..--max ({a.max}), not {a.baseline}")
    before = leak_counts(WORK)
    limits = (a.deadline * 60, a.exec_limit, a.swap_gib)
    off, _ = asyncio.run(hold("defaults", a.baseline, *limits))
    rows = {"defaults": off}
    stopped = ""
    for mode in ("zswap", "swap"):
        # zswap is a host setting: off for the swap-file mode only, then as it was.
        enabled = (swap.ZSWAP / "enabled").read_text().strip()
        try:
            (swap.ZSWAP / "enabled").write_text("Y" if mode == "zswap" else "N")
            n = a.max if mode == a.long else a.baseline
            rows[mode], why = asyncio.run(hold(mode, n, *limits))
        finally:
            (swap.ZSWAP / "enabled").write_text(enabled)
        if mode == a.long:
            stopped = why
    after = leak_counts(WORK)
    header = ["node", "VMs held", "host MiB per VM", "cgroup MiB per VM", "swap MiB per VM",
              "host CPU busy", "exec p50 (ms)", "exec p99 (ms)"]  # fmt: skip
    sections = [
        f"microVMs ({accelerator()}), 256 MiB of guest memory each, debian-python; each runs "
        "`python3 -c 'import json, email, http.client'` once after its boot, then idles. "
        f"`savers on`: a {NodeConfig().vm_tcg_cache_mib} MiB TCG code cache, free page "
        "reporting, a quiet idle guest (`vm_quiet_idle`: no PIT, the guest kernel's watchdog, "
        "pressure averaging, per-second statistics and proactive compaction off), "
        f"reclaim_after {RECLAIM_AFTER:.0f} s into a swap file, through zswap "
        "(compressed in memory) or straight to the file (zswap turned off for that part). "
        f"Host memory is MemTotal - MemAvailable less before the VMs, {SETTLE:.0f} s after "
        "each checkpoint, per VM (the zswap pool included); cgroup is what the kernel charges "
        "the VMs' QEMUs (guest memory and the emulator's own); swap is what went to the swap "
        f"file (disk); host CPU is the machine's busy share over those {SETTLE:.0f} s. Exec: "
        "`true` on a sample of up to 8 of the held VMs.",
        table(header, rows["defaults"] + rows["zswap"] + rows["swap"]),
        f"What stopped the long run ({LABELS[a.long]}, up to --max {a.max}): {stopped}. "
        "Target (issue 20): <= 64 MiB per idle microVM (199 before this work, "
        "bench/results/vm.md).",
        "## Leftovers (host-wide, before the run vs after)\n\n"
        + table(
            ["object", "before", "after"], [[k, str(before[k]), str(after[k])] for k in before]
        ),
    ]
    write_result("vmdensity", "Idle microVMs per host", sections)


if __name__ == "__main__":
    main()
