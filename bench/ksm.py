"""KSM for idle microVMs: does merging identical guest pages pay here?

    python bench/ksm.py [--vms 6] [--quick]

Starts N idle microVMs (256 MiB each, a little real work in each, then
idle), measures host memory per VM with the kernel's same-page merging
off, then turns ksmd on (QEMU marks guest RAM mergeable by default,
mem-merge=on) and measures again once ksmd has scanned everything twice,
with what ksmd cost in CPU and what it did to an exec round trip. The
host's KSM settings are put back as they were after the run (merged pages
unmerged first if KSM was off).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corral
from _common import IMAGE, IMAGES, fresh_dir, mem_used, pct, table, write_result
from corral.config import NodeConfig
from corral.runtimes.vm.qemu import accelerator

WORK = Path("/var/lib/corral-bench-ksm")
KSM = Path("/sys/kernel/mm/ksm")
PAGE = 4096


def ksm(name: str) -> int:
    return int((KSM / name).read_text())


def set_ksm(name: str, value: int) -> None:
    (KSM / name).write_text(str(value))


def ksmd_cpu() -> float:
    """CPU seconds ksmd has used (utime + stime of the kernel thread)."""
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if (p / "comm").read_text().strip() == "ksmd":
                    fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
                    return (int(fields[11]) + int(fields[12])) / 100
            except OSError:
                continue
    return 0.0


async def exec_ms(boxes: list[corral.AsyncSandbox], n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        await boxes[i % len(boxes)].commands.run(["true"])
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def run(n: int) -> list[str]:
    cfg = NodeConfig.from_env(data_dir=WORK, images=IMAGES, node="ksm", scratch_size=4 * 2**30)
    fresh_dir(cfg.data_dir)
    saved = {k: ksm(k) for k in ("run", "pages_to_scan", "sleep_millisecs")}
    if saved["run"] == 1:
        raise SystemExit("KSM is already running on this host: nothing to compare")
    try:
        async with corral.AsyncClient(config=cfg) as c:
            before = mem_used()
            boxes = []
            for i in range(n):
                s = await c.sandboxes.create(
                    kind="microvm", image=IMAGE, memory="256MiB", disk="256MiB"
                )
                await s.commands.run("python3 -c 'import json, email, http.client'")
                boxes.append(s)
                print(f"{i + 1}/{n} VMs", file=sys.stderr)
            await asyncio.sleep(10)
            off_used = (mem_used() - before) / n / 2**20
            off_exec = await exec_ms(boxes, 60)
            cpu0, t0 = ksmd_cpu(), time.monotonic()
            set_ksm("pages_to_scan", 2000)  # ~ 400 MB/s: converges in a run's time
            set_ksm("sleep_millisecs", 20)
            set_ksm("run", 1)
            scans = ksm("full_scans")
            while ksm("full_scans") < scans + 2:  # noqa: ASYNC110 (a kernel counter)
                await asyncio.sleep(1)
            converge_s = time.monotonic() - t0
            cpu_converge = ksmd_cpu() - cpu0
            await asyncio.sleep(5)
            on_used = (mem_used() - before) / n / 2**20
            sharing = ksm("pages_sharing") * PAGE / 2**20
            cpu1, t1 = ksmd_cpu(), time.monotonic()
            on_exec = await exec_ms(boxes, 60)
            await asyncio.sleep(10)  # ksmd's steady cost, everything merged
            steady = (ksmd_cpu() - cpu1) / (time.monotonic() - t1)
            for s in boxes:
                await s.close()
    finally:
        if saved["run"] == 0:
            set_ksm("run", 2)  # unmerge what was merged, then off as it was
        for k in ("pages_to_scan", "sleep_millisecs", "run"):
            set_ksm(k, saved[k])
    rows = [
        ["off", f"{off_used:.0f}", "-", f"{pct(off_exec, 50):.2f}", f"{pct(off_exec, 99):.2f}",
         "-", "-"],
        ["on", f"{on_used:.0f}", f"{sharing / n:.0f}", f"{pct(on_exec, 50):.2f}",
         f"{pct(on_exec, 99):.2f}", f"{cpu_converge:.1f} s in {converge_s:.0f} s",
         f"{steady * 100:.1f}%"],
    ]  # fmt: skip
    saving = 1 - on_used / off_used
    return [
        f"{n} idle microVMs ({accelerator()}), 256 MiB each, each having imported a few Python "
        "modules once. Host memory is MemTotal - MemAvailable less before the VMs, per VM, "
        "10 s after the last was made (off) and 5 s after ksmd's second full scan (on: "
        "pages_to_scan 2000, sleep_millisecs 20). Exec: `true`, 60 round trips over the VMs.",
        table(HEADER, rows),
        f"KSM saved **{saving:.0%}** of host memory per idle VM here.",
    ]


HEADER = [
    "KSM", "host MiB per VM", "MiB merged away per VM", "exec p50 (ms)", "exec p99 (ms)",
    "ksmd CPU to converge", "ksmd CPU after (of a core)",
]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vms", type=int, default=6)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    sections = asyncio.run(run(3 if a.quick else a.vms))
    write_result("ksm", "KSM for idle microVMs", sections)


if __name__ == "__main__":
    main()
