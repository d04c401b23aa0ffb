"""MicroVMs, measured next to containers in the same run: create to agent
ready, exec round trip, and host memory per idle VM.

    corral bench vm [--creates 10] [--execs 100] [--idle 8]

The accelerator is printed with the table: TCG on these hosts (their
/dev/kvm is nested PVM, on which a stock guest kernel hangs), KVM elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corral
from _common import IMAGE, IMAGES, fresh_dir, leak_counts, mem_used, pct, table, write_result
from corral.config import NodeConfig
from corral.runtimes.vm.qemu import accelerator

WORK = Path("/var/lib/corral-vm")


def pss(pid: int) -> int:
    """Proportional set size of a process, bytes (shared pages split)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


async def creates(c: corral.AsyncClient, kind: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        s = await c.sandboxes.create(kind=kind, image=IMAGE, memory="256MiB", disk="256MiB")
        out.append(time.perf_counter() - t0)
        await s.close()
    return out


async def execs(c: corral.AsyncClient, kind: str, n: int) -> list[float]:
    s = await c.sandboxes.create(kind=kind, image=IMAGE, memory="256MiB", disk="256MiB")
    try:
        await s.commands.run("true")
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await s.commands.run(["true"])
            out.append(time.perf_counter() - t0)
        return out
    finally:
        await s.close()


async def snapshots(c: corral.AsyncClient, n: int) -> list[list[str]]:
    """suspend: save to disk and stop; resume: a new QEMU loads the state and
    the agent answers. State size with a 256 MiB guest after a little work."""
    s = await c.sandboxes.create(kind="microvm", image=IMAGE, memory="256MiB", disk="256MiB")
    sus, res, sizes = [], [], []
    try:
        await s.commands.run("python3 -c 'import json'")
        for _ in range(n):
            t0 = time.perf_counter()
            await s.suspend()
            sus.append(time.perf_counter() - t0)
            sizes.append(
                sum(f.stat().st_size for f in WORK.glob(f"sandboxes/{s.id}/vm.state")) / 2**20
            )
            t0 = time.perf_counter()
            await s.resume()
            await s.commands.run(["true"])
            res.append(time.perf_counter() - t0)
    finally:
        await s.close()

    def ms(v: list[float]) -> list[str]:
        return [f"{pct(v, 50) * 1000:.0f} ms", f"{pct(v, 99) * 1000:.0f} ms"]

    return [
        ["suspend (save + stop)", str(n), *ms(sus)],
        ["resume to first answer", str(n), *ms(res)],
        ["state size", str(n), f"{pct(sizes, 50):.0f} MiB", f"{pct(sizes, 99):.0f} MiB"],
    ]


async def idle(c: corral.AsyncClient, n: int, sandboxes_dir: Path) -> tuple[float, float, float]:
    """Host memory per idle VM: (MemAvailable drop, mean QEMU PSS, mean RSS), MiB."""
    before = mem_used()
    boxes = [
        await c.sandboxes.create(kind="microvm", image=IMAGE, memory="256MiB", disk="256MiB")
        for _ in range(n)
    ]
    for s in boxes:
        await s.commands.run("python3 -c 'import json'")  # a little real work, then idle
    await asyncio.sleep(5)
    used = (mem_used() - before) / n / 2**20
    pids = [int((sandboxes_dir / s.id / "qemu.pid").read_text()) for s in boxes]
    pss_mib = sum(pss(p) for p in pids if p) / n / 2**20
    rss = 0
    for p in pids:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss += int(line.split()[1]) * 1024
    for s in boxes:
        await s.close()
    return used, pss_mib, rss / n / 2**20


async def main(n_create: int, n_exec: int, n_idle: int) -> None:
    fresh_dir(WORK)
    before = leak_counts(WORK)
    cfg = NodeConfig.from_env(data_dir=WORK, images=IMAGES, node="vmb")
    accel = accelerator()
    rows, exec_rows = [], []
    async with corral.AsyncClient(config=cfg) as c:
        await creates(c, "microvm", 1)  # builds or finds the guest artefacts
        for kind in ("container", "microvm"):
            t = await creates(c, kind, n_create)
            rows.append(
                [kind, str(n_create), f"{pct(t, 50) * 1000:.0f}", f"{pct(t, 99) * 1000:.0f}"]
            )
            e = await execs(c, kind, n_exec)
            exec_rows.append(
                [kind, str(n_exec), f"{pct(e, 50) * 1000:.2f}", f"{pct(e, 99) * 1000:.2f}"]
            )
            print(rows[-1], exec_rows[-1], flush=True)
        snap_rows = await snapshots(c, 5)
        print(snap_rows, flush=True)
        used, pss_mib, rss = await idle(c, n_idle, cfg.sandboxes_dir)
    after = leak_counts(WORK)
    ratio = float(rows[1][2]) / float(rows[0][2])
    sections = [
        f"## Create to agent ready (accelerator: {accel})\n\n"
        "Sequential creates of `debian-python:bookworm` (256 MiB, 256 MiB disk); a microVM "
        "boots Debian's 6.1 kernel (uncompressed vmlinux, PVH entry), loads its modules, "
        "mounts the image's EROFS layers from virtio-blk drives under an overlay, and its "
        "agent answers on a virtio-serial port.\n\n"
        + table(["kind", "creates", "p50 (ms)", "p99 (ms)"], rows)
        + f"\n\nmicroVM / container, p50: {ratio:.1f}x.",
        "## Exec round trip (`true`)\n\n"
        "A microVM's request crosses the host multiplexer, QEMU's chardev and the guest's "
        "virtio-serial port; a container's goes straight to its init's socket.\n\n"
        + table(["kind", "runs", "p50 (ms)", "p99 (ms)"], exec_rows),
        "## Suspend and resume (QMP migrate to a file; a new QEMU with `-incoming`)\n\n"
        + table(["what", "rounds", "p50", "p99"], snap_rows),
        f"## Host memory per idle microVM ({n_idle} at once, {accel})\n\n"
        + table(
            ["VMs", "host memory in use, per VM (MiB)", "QEMU PSS per VM (MiB)", "RSS (MiB)"],
            [[str(n_idle), f"{used:.0f}", f"{pss_mib:.0f}", f"{rss:.0f}"]],
        ),
        "## Leftovers (host-wide, before vs after)\n\n"
        + table(["object", "before", "after"], [[k, str(before[k]), str(after[k])] for k in after]),
    ]
    path = write_result("vm", "MicroVMs next to containers", sections)
    print(f"wrote {path}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--creates", type=int, default=10)
    ap.add_argument("--execs", type=int, default=100)
    ap.add_argument("--idle", type=int, default=8)
    a = ap.parse_args()
    asyncio.run(main(a.creates, a.execs, a.idle))
