"""Warm sandboxes vs cold creates vs bare crun, in one run.

    python bench/warmpool.py [--n 60] [--quick]

Create to ready (the sandbox's exec server answered) one at a time: a cold
Corral create; a create claimed from a warm pool that has refilled since
the last (the steady state of a job creating a sandbox every few hundred
milliseconds); and bare crun (create + start of the same bundle running
`sleep`, bench/container.py's peer). Then sustained creation, 16 in flight:
cold, and with a warm pool of 64 that refills as it is drained.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corral
from _common import IMAGE, IMAGES, fresh_dir, host_busy, pct, table, write_result
from container import Peer, remove_peer_base, remove_peer_cgroups
from corral.api.models import CreateSandbox, validated
from corral.config import NodeConfig
from corral.images.mounter import LayerMounts
from corral.images.store import ImageStore
from corral.node.agent import NodeAgent

WORK = Path("/var/lib/corral-bench-warm")
T = TypeVar("T")
SPEC: dict[str, Any] = {"image": IMAGE, "memory": "256MiB"}


async def timed(aw: Awaitable[T]) -> tuple[float, T]:
    t0 = time.perf_counter()
    out = await aw
    return time.perf_counter() - t0, out


async def refilled(agent: NodeAgent, want: int, timeout: float = 60.0) -> None:
    pool = agent.parts.warm
    deadline = time.monotonic() + timeout
    while pool.held() < want or any(pool._making.values()):
        if time.monotonic() > deadline:
            raise TimeoutError("the warm pool did not refill")
        await asyncio.sleep(0.02)


async def one_at_a_time(client: corral.AsyncClient, n: int, warm: int) -> list[float]:
    agent = client.service
    assert isinstance(agent, NodeAgent)
    out = []
    for _ in range(n):
        if warm:
            await refilled(agent, warm)
        t, sbx = await timed(client.sandboxes.create(**SPEC))
        out.append(t)
        await sbx.close()
    return out


async def sustained(
    create: Callable[[], Awaitable[T]], close: Callable[[T], Awaitable[object]], total: int
) -> tuple[float, float]:
    """(creates per second, host CPU ms per create) with 16 in flight."""
    sem = asyncio.Semaphore(16)
    made: list[T] = []

    async def one() -> None:
        async with sem:
            made.append(await create())

    busy, t0 = host_busy(), time.perf_counter()
    await asyncio.gather(*(one() for _ in range(total)))
    rate = total / (time.perf_counter() - t0)
    cpu_ms = (host_busy() - busy) / total * 1000
    await asyncio.gather(*(close(s) for s in made))
    return rate, cpu_ms


async def churn(
    create: Callable[[], Awaitable[T]], close: Callable[[T], Awaitable[object]], total: int
) -> tuple[float, float]:
    """(sandboxes per second, host CPU ms per sandbox) through a whole life,
    create then close, 16 at a time: a rollout's steady state, where every
    create has a close beside it."""
    left = total

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await close(await create())

    busy, t0 = host_busy(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(16)))
    return total / (time.perf_counter() - t0), (host_busy() - busy) / total * 1000


async def run(n: int, total: int) -> list[str]:
    store = ImageStore(IMAGES)
    peer_mounts = LayerMounts(store, fresh_dir(WORK / "peer-m"))
    try:
        return await _run(n, total, Peer("crun", peer_mounts.ensure(store.resolve(IMAGE))))
    finally:
        peer_mounts.release_unused(list)
        remove_peer_cgroups()
        remove_peer_base()
        shutil.rmtree(WORK, ignore_errors=True)


async def _run(n: int, total: int, crun: Peer) -> list[str]:
    lat: dict[str, list[float]] = {}
    rates: dict[str, tuple[float, float]] = {}
    lives: dict[str, tuple[float, float]] = {}
    # The node's runtime (the default, or CORRAL_OCI_RUNTIME), then crun's
    # cold path in the same run: what Corral's own runtime is worth.
    default = NodeConfig.from_env().oci_runtime
    paths = [("Corral, cold", 0, default), ("Corral, warm pool of 64", 64, default)]
    if default != "crun":
        paths.append(("Corral on crun, cold", 0, "crun"))
    for name, size, runtime in paths:
        cfg = NodeConfig.from_env(
            data_dir=fresh_dir(WORK / f"{size}-{runtime}"), images=IMAGES,
            node=f"w{size}{runtime[:2]}", warm_pool=size, scratch_size=16 * 2**30,
            oci_runtime=runtime,
        )  # fmt: skip
        async with corral.AsyncClient(config=cfg) as client:
            await one_at_a_time(client, 3, 0)  # layers mounted, caches warm, demand noted
            lat[name] = await one_at_a_time(client, n, 1 if size else 0)
            if size:  # a burst announced: the pool fills to its size
                agent = client.service
                assert isinstance(agent, NodeAgent)
                agent.parts.warm.expect(validated(CreateSandbox, SPEC), size)
                await refilled(agent, size, timeout=300)
            rates[name] = await sustained(
                lambda: client.sandboxes.create(**SPEC), lambda s: s.close(), total
            )
            if not size:
                lives[name] = await churn(
                    lambda: client.sandboxes.create(**SPEC), lambda s: s.close(), total
                )
    rates["bare crun (create + start)"] = await sustained(crun.create, crun.delete, total)
    lives["bare crun (create + start, delete)"] = await churn(crun.create, crun.delete, total)
    peer: list[float] = []
    for _ in range(n):
        t, cid = await timed(crun.create())
        peer.append(t)
        await crun.delete(cid)
    base = pct(peer, 50)
    rows = [
        [label, f"{pct(v, 50) * 1000:.1f}", f"{pct(v, 99) * 1000:.1f}",
         f"{pct(v, 50) / base:.2f}x", f"{pct(v, 99) / pct(peer, 99):.2f}x"]
        for label, v in (("Corral, cold", lat["Corral, cold"]),
                         ("Corral, claimed warm", lat["Corral, warm pool of 64"]),
                         *((("Corral on crun, cold", lat["Corral on crun, cold"]),)
                           if "Corral on crun, cold" in lat else ()),
                         ("bare crun (create + start)", peer))
    ]  # fmt: skip
    return [
        f"Corral's runtime: {default} (oci_runtime; `corral` is its own, native/corral-run)"
        + (", and crun's cold path beside it in the same run." if default != "crun" else "."),
        "## Create to ready, one at a time (ms)\n\n"
        f"{n} creates each. Corral's ready: its exec server answered, every defence on "
        "(user namespace, seccomp with notify, masks); the warm pool had refilled before "
        "each claim. bare crun: the same bundle's create + start, `sleep` as its process, its "
        "state on a tmpfs (as /run/crun on a Linux host; Corral's is on its run tmpfs).",
        table(["path", "p50", "p99", "p50 vs crun", "p99 vs crun"], rows),
        "Target (issue 20): claimed p50 <= 0.5x bare crun, p99 <= 1x.",
        "## Sustained creation, 16 in flight\n\n"
        f"{total} creates. `warm`: a pool of 64 full at the start, refilled (one at a time, "
        "in the same agent) while it is drained: the 64 made before the clock started are "
        "among the 300, so its rate is the cold rate times up to 300/236. Host CPU: the whole "
        "machine's busy time (/proc/stat, kernel included) during the run, per create.",
        table(
            ["path", "sandboxes/s", "host CPU ms per create", "rate vs crun"],
            [
                [k, f"{r:.1f}", f"{ms:.1f}", f"{r / rates['bare crun (create + start)'][0]:.2f}x"]
                for k, (r, ms) in rates.items()
            ],
        ),
        "Target (issue 20): >= 150/s sustained on 2 cores, i.e. at most 13.3 ms of the "
        "machine's CPU per create, everything included.",
        "## Whole lives, 16 at a time\n\n"
        f"{total} sandboxes, each created then closed by one of 16 workers: the steady "
        "state of a rollout, every create beside a close. Host CPU per sandbox, create "
        "and close together.",
        table(
            ["path", "sandboxes/s", "host CPU ms per sandbox", "rate vs crun"],
            [
                [
                    k,
                    f"{r:.1f}",
                    f"{ms:.1f}",
                    f"{r / lives['bare crun (create + start, delete)'][0]:.2f}x",
                ]
                for k, (r, ms) in lives.items()
            ],
        ),
    ]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=60)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    n, total = (20, 100) if a.quick else (a.n, 300)
    write_result(
        "warmpool", "Warm sandboxes vs cold creates vs bare crun", asyncio.run(run(n, total))
    )


if __name__ == "__main__":
    main()
