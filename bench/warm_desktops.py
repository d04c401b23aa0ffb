"""Container desktops claimed warm vs created cold, in one run, on twm's
image and on XFCE's.

    corral bench warm_desktops [--n 10]

Create to drawn one at a time (create returns once the desktop is on the
screen, docs/display.md): a cold create (Xvfb and the session started by
the create, `warm_pool = 0`), and a create claimed from a warm pool of one
that has refilled since the last claim (the steady state of a job that
starts a desktop every few seconds). The refill is a cold create in the
background; its time is reported beside. Every claimed desktop's first
screenshot is checked to show a desktop (more than one distinct row).
Then the host memory a warm desktop holds while it waits.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corral
from _common import IMAGES, fresh_dir, leak_counts, pct, table, write_result
from corral.config import NodeConfig
from corral.node.agent import NodeAgent
from corral.runtimes.vm import desktop, pixels, xfce
from desktop_kinds import container_memory
from warmpool import refilled

WORK = Path("/var/lib/corral-bench-warmdesk")
SIZE = "1280x800"
IMAGES_UNDER_TEST = {
    "twm": (desktop.BASE, desktop.TOOLKIT, "1GiB"),
    "XFCE": (xfce.BASE, xfce.TOOLKIT, "2GiB"),
}


def spec_of(name: str) -> dict[str, Any]:
    image, toolkit, memory = IMAGES_UNDER_TEST[name]
    return {"image": image, "toolkit": [toolkit], "memory": memory, "display_size": SIZE}


async def drawn_on_first_look(c: corral.AsyncClient, s: corral.AsyncSandbox) -> None:
    """Its screen, as the create handed it out, shows a desktop."""
    agent = c.service
    assert isinstance(agent, NodeAgent)
    _, screen = await agent.parts.displays._desktop(s.id)
    if pixels.distinct_colours(await screen.frame(), 2) < 2:
        raise RuntimeError(f"{s.id} was handed out with a blank screen")


async def cold(c: corral.AsyncClient, spec: dict[str, Any], n: int) -> list[float]:
    await (await c.sandboxes.create(**spec)).close()  # page cache, chunk cache
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        s = await c.sandboxes.create(**spec)
        out.append(time.perf_counter() - t0)
        await drawn_on_first_look(c, s)
        await s.close()
    return out


async def warm(c: corral.AsyncClient, spec: dict[str, Any], n: int) -> dict[str, Any]:
    agent = c.service
    assert isinstance(agent, NodeAgent)
    await (await c.sandboxes.create(**spec)).close()  # its ask starts the pool
    claims, refills = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        await refilled(agent, 1, timeout=300)
        refills.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        s = await c.sandboxes.create(**spec)
        claims.append(time.perf_counter() - t0)
        await drawn_on_first_look(c, s)
        await s.close()
    await refilled(agent, 1, timeout=300)
    await asyncio.sleep(20)  # idle, as a warm desktop waits
    (warm_id,) = [i for q in agent.parts.warm._ready.values() for i in q]
    own, charge = container_memory(agent.config, warm_id)
    return {"claim": claims, "refill": refills, "pss": own, "charge": charge}


async def main(a: argparse.Namespace) -> None:
    fresh_dir(WORK)
    before = leak_counts(WORK)
    base = NodeConfig.from_env(data_dir=WORK / "cold", images=IMAGES, node="wd0")
    got: dict[str, dict[str, Any]] = {}
    for name in IMAGES_UNDER_TEST:
        spec = spec_of(name)
        async with corral.AsyncClient(config=replace(base, warm_pool=0)) as c:
            got[name] = {"cold": await cold(c, spec, a.n)}
            print(f"{name} cold p50 {pct(got[name]['cold'], 50):.2f}s", flush=True)
        warm_cfg = replace(base, data_dir=WORK / "warm", node="wd1", warm_pool=1)
        async with corral.AsyncClient(config=warm_cfg) as c:
            got[name] |= await warm(c, spec, a.n)
            print(f"{name} claimed p50 {pct(got[name]['claim'], 50) * 1000:.1f}ms", flush=True)
    after = leak_counts(WORK)

    rows = []
    for name, r in got.items():
        rows.append([
            name,
            f"{pct(r['cold'], 50):.2f}", f"{pct(r['cold'], 99):.2f}",
            f"{pct(r['claim'], 50) * 1000:.0f} ms", f"{pct(r['claim'], 99) * 1000:.0f} ms",
            f"{pct(r['claim'], 50) / pct(r['cold'], 50):.3f}x",
            f"{pct(r['refill'], 50):.2f}",
        ])  # fmt: skip
    mem = [
        [name, f"{r['pss'] / 2**20:.0f}", f"{r['charge'] / 2**20:.0f}"] for name, r in got.items()
    ]
    head = ["image", "cold p50 (s)", "cold p99 (s)", "claimed p50", "claimed p99"]
    head += ["claimed / cold", "refill p50 (s)"]
    sections = [
        f"## Create to drawn, one at a time ({a.n} each, {SIZE})\n\n"
        "Cold: `warm_pool = 0`, the create starts Xvfb and the image's session and returns "
        "once it is drawn. Claimed: `warm_pool = 1`, the pool refilled before each create "
        "(the wait for it is the refill column: a cold create in the background, started when "
        "the last claim took the pool's desktop). Each claimed desktop's first screenshot "
        "showed a desktop.\n\n"
        + table(head, rows)
        + "\n\nTarget (issue 21, TCG): a container desktop drawn within 1 s of create.",
        "## What a warm desktop holds while it waits (MiB, 20 s idle)\n\n"
        + table(["image", "PSS of its processes", "its memory cgroup's charge"], mem),
        "## Leftovers\n\n"
        + table(
            ["object", "before", "after"], [[k, str(before[k]), str(after[k])] for k in before]
        ),
    ]
    print(write_result("warm-desktops", "Container desktops: claimed warm vs cold", sections))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10)
    asyncio.run(main(ap.parse_args()))
