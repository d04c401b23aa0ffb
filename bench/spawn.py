"""How the agent waits on a helper process: asyncio's subprocess (a thread
per child, ThreadedChildWatcher) against host/spawn.py (the child's pidfd
watched by the loop), the same helper, the same run, rounds interleaved.

A create and a close each spawn one helper (corral-nsexec running crun);
this measures what waiting on it costs the agent's process, with the
agent's heap around it (a large Python process forks as the agent does).

  corral bench spawn [--n 400] [--rounds 6]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median, pct, table, write_result
from corral.host import spawn

HELPER = ["/bin/true"]
IN_FLIGHT = 16
HEADER = ["how the agent waits", "spawns/s", "agent CPU ms each", "vs asyncio", "p50 ms", "p99 ms"]


async def with_asyncio() -> None:
    proc = await asyncio.create_subprocess_exec(
        *HELPER, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    await proc.communicate()


async def with_pidfd() -> None:
    await spawn.run(HELPER)


def cpu() -> float:
    """This process's CPU, every thread (not its children's)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def round_of(n: int, one: Callable[[], Awaitable[None]]) -> tuple[float, float, list[float]]:
    """(spawns/s, agent CPU ms per spawn, each spawn's latency in s)."""
    sem = asyncio.Semaphore(IN_FLIGHT)
    lat: list[float] = []

    async def timed() -> None:
        async with sem:
            t = time.perf_counter()
            await one()
            lat.append(time.perf_counter() - t)

    c0, t0 = cpu(), time.perf_counter()
    await asyncio.gather(*(timed() for _ in range(n)))
    wall = time.perf_counter() - t0
    return n / wall, (cpu() - c0) / n * 1000, lat


async def run(n: int, rounds: int) -> list[list[str]]:
    ways = {
        "asyncio subprocess (thread per child)": with_asyncio,
        "host/spawn.py (pidfd)": with_pidfd,
    }
    got: dict[str, list[tuple[float, float, list[float]]]] = {k: [] for k in ways}
    for _ in range(rounds):
        for name, one in ways.items():
            got[name].append(await round_of(n, one))
    rows = []
    base = median([r[1] for r in got[next(iter(ways))]])
    for name, rs in got.items():
        ms = median([r[1] for r in rs])
        lat = [x for r in rs for x in r[2]]
        rows.append([
            name, f"{median([r[0] for r in rs]):.0f}", f"{ms:.3f}", f"{ms / base:.2f}x",
            f"{pct(lat, 50) * 1000:.2f}", f"{pct(lat, 99) * 1000:.2f}",
        ])  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=400, help="spawns per round")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of each, interleaved")
    a = ap.parse_args()
    heap = [bytes(64) * 1024 for _ in range(4096)]  # ~256 MiB of heap, as a busy agent has
    rows = asyncio.run(run(a.n, a.rounds))
    del heap
    path = write_result(
        "spawn",
        "Waiting on a helper process: asyncio's thread per child against a pidfd",
        [
            f"`{' '.join(HELPER)}` spawned {a.n} times per round, {IN_FLIGHT} in flight, "
            f"{a.rounds} rounds of each interleaved, from a process holding ~256 MiB of heap. "
            "Agent CPU: the spawning process's own (all its threads), not the child's; "
            "medians over rounds. Latency: spawn to reaped, every spawn of every round.",
            table(HEADER, rows),
        ],
    )
    print(path)


if __name__ == "__main__":
    main()
