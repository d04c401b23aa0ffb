"""Density: idle sandboxes held at once and host memory per idle sandbox.

    corral bench density [--max 2000]

Starts idle Corral sandboxes (16 creates in flight) up to --max, measuring
host memory (MemTotal - MemAvailable, and slab) at checkpoints, then checks
that a sample still answers. The peer is bare crun with the same bundle
running `sleep infinity`, measured the same way in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corral
from _common import (
    IMAGE,
    IMAGES,
    leak_counts,
    median,
    mem_used,
    meminfo,
    pct,
    table,
    write_result,
)
from container import BASE, Peer
from corral.config import NodeConfig
from corral.images.mounter import LayerMounts
from corral.images.store import ImageStore

DATA = Path("/var/lib/corral-density")


def pss_of(comm: str, sample: int = 50) -> float:
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "comm").read_text().strip() == comm:
                    pids.append(d)
            except OSError:
                pass
    vals = []
    for d in random.sample(pids, min(sample, len(pids))):
        try:
            for line in (d / "smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    vals.append(int(line.split()[1]) * 1024)
        except OSError:
            pass
    return median([float(v) for v in vals]) if vals else 0.0


async def settle() -> tuple[int, int]:
    await asyncio.sleep(3)
    return mem_used(), meminfo("Slab")


async def main(maximum: int) -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    checkpoints = [n for n in (100, 250, 500, 1000, 1500, 2000, 3000) if n < maximum] + [maximum]
    cfg = NodeConfig.from_env(
        data_dir=DATA, images=IMAGES, node="dens", max_sandboxes=4096, scratch_size=256 * 2**30
    )
    sem = asyncio.Semaphore(16)
    rows: list[list[str]] = []
    before = leak_counts(DATA)
    async with corral.AsyncClient(config=cfg) as client:
        warm = await client.sandboxes.create(image=IMAGE, memory="64MiB")
        await warm.close()
        base_mem, base_slab = await settle()
        boxes: list[corral.AsyncSandbox] = []

        async def one() -> None:
            async with sem:
                boxes.append(
                    await client.sandboxes.create(
                        image=IMAGE, memory="64MiB", disk="256MiB", ttl=7200, idle_timeout=None
                    )
                )

        t0 = time.perf_counter()
        for cp in checkpoints:
            await asyncio.gather(*(one() for _ in range(cp - len(boxes))))
            mem, slab = await settle()
            rows.append(
                [
                    "corral",
                    str(len(boxes)),
                    f"{(mem - base_mem) / len(boxes) / 2**20:.2f}",
                    f"{(slab - base_slab) / len(boxes) / 2**20:.2f}",
                    f"{pss_of('corral-init') / 2**10:.0f}",
                ]
            )
            print(rows[-1], flush=True)
        create_wall = time.perf_counter() - t0
        sample = random.sample(boxes, 20)
        lat = []
        for s in sample:
            t = time.perf_counter()
            r = await s.commands.run(["true"])
            lat.append(time.perf_counter() - t)
            assert r.exit_code == 0
        held = len(await client.sandboxes.list())
        t0 = time.perf_counter()

        async def close(s: corral.AsyncSandbox) -> None:
            async with sem:
                await s.close()

        await asyncio.gather(*(close(s) for s in boxes))
        close_wall = time.perf_counter() - t0

    # The peer: bare crun, same bundle, `sleep infinity`.
    store = ImageStore(IMAGES)
    mounts = LayerMounts(store, BASE / "m")
    lower = mounts.ensure(store.resolve(IMAGE))
    peer = Peer("crun", lower)
    base_mem, base_slab = await settle()
    ids: list[str] = []

    async def pone() -> None:
        async with sem:
            ids.append(await peer.create())

    for cp in checkpoints:
        await asyncio.gather(*(pone() for _ in range(cp - len(ids))))
        mem, slab = await settle()
        rows.append(
            [
                "bare crun + sleep",
                str(len(ids)),
                f"{(mem - base_mem) / len(ids) / 2**20:.2f}",
                f"{(slab - base_slab) / len(ids) / 2**20:.2f}",
                f"{pss_of('sleep') / 2**10:.0f}",
            ]
        )
        print(rows[-1], flush=True)
    await asyncio.gather(*(peer.delete(i) for i in ids))
    mounts.release_unused([])
    shutil.rmtree(BASE, ignore_errors=True)
    for h in Path("/sys/fs/cgroup").iterdir():
        for parent in ("corral/benchcrun", "corral"):
            try:
                (h / parent).rmdir()
            except OSError:
                pass
    await asyncio.sleep(3)
    after = leak_counts(DATA)

    sections = [
        "## Host memory per idle sandbox\n\n"
        "Host memory is MemTotal - MemAvailable, measured 3 s after each checkpoint, minus "
        "the value before the first sandbox, divided by the sandboxes held. Slab is the "
        "kernel's share of it. PSS is the median proportional set size of one sandbox's "
        "process (corral-init, or the peer's `sleep`), from a sample of 50.\n\n"
        + table(
            [
                "system",
                "sandboxes held",
                "host MiB / sandbox",
                "slab MiB / sandbox",
                "process PSS KiB",
            ],
            rows,
        )
        + f"\n\nTarget: <= 2 MiB per idle sandbox, and {maximum} held at once.",
        "## Holding them\n\n"
        + table(
            [
                "sandboxes held (listed)",
                "create wall (s)",
                "rate (/s)",
                "exec `true` p50 (ms)",
                "exec p99 (ms)",
                "close wall (s)",
            ],
            [
                [
                    str(held),
                    f"{create_wall:.1f}",
                    f"{maximum / create_wall:.1f}",
                    f"{median(lat) * 1000:.2f}",
                    f"{pct(lat, 99) * 1000:.2f}",
                    f"{close_wall:.1f}",
                ]
            ],
        )
        + "\n\nExec latency is over 20 sandboxes picked at random while all are held.",
        "## Leftovers (host-wide, before the run vs after)\n\n"
        + table(
            ["object", "before", "after"], [[k, str(before[k]), str(after[k])] for k in before]
        ),
    ]
    path = write_result("density", "Density: idle sandboxes per host", sections)
    print(path.read_text())


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--max", type=int, default=2000)
    args = ap.parse_args()
    asyncio.run(main(args.max))
