"""DSec's second memory experiment, for containers or microVMs: the
time-integrated host memory of a population of idle-heavy sandboxes, with
idle reclaim off and on, and what it costs the agent's next command.

    python bench/reclaim.py [--kind container|microvm] [--sandboxes N] [--seconds 120] [--quick]

Each sandbox runs a Python process that imported a few packages and built
its state (a daemon, as an agent's REPL or server would be), then follows
an agent's trace: think (exponential, mean 15 s), then a burst of three
commands 0.3 s apart; the same seeded trace in both phases. Phase `off`:
the node has its swap file but no reclaim; phase `on`: reclaim_after 5 s
(an idle sandbox's memory goes through zswap to the swap file). Host memory
is MemTotal - MemAvailable, sampled every 0.5 s, less what it was before
the sandboxes; the zswap pool counts (it is host memory).
DSec reports 21.2% saved for VMs; issue 20's target is >= 25% for these
containers, with the next command's p99 reported.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import corral  # noqa: E402
from _common import IMAGE, IMAGES, fresh_dir, mem_used, pct, table, write_result  # noqa: E402
from corral import metrics  # noqa: E402
from corral.config import NodeConfig  # noqa: E402
from corral.host import swap  # noqa: E402
from corral.node.agent import NodeAgent  # noqa: E402
from corral.runtimes.vm.qemu import accelerator  # noqa: E402

WORK = Path("/var/lib/corral-bench-reclaim")
RESIDENT = (
    "nohup python3 -c '"
    "import json, decimal, email.parser, http.client, xml.dom.minidom, sqlite3, asyncio, "
    "logging, argparse, unittest, time\n"
    'state = [{"step": i, "obs": str(i) * 8} for i in range(120000)]\n'
    "time.sleep(10**6)' >/dev/null 2>&1 &"
)
BURST = [
    "python3 -c 'import json; print(json.dumps({\"ok\": 1}))'",
    "ls -la /tmp",
    "cat /etc/os-release",
]
THINK_MEAN = 15.0
RECLAIM_AFTER = 5.0


async def phase(
    kind: str, reclaim: bool, sandboxes: int, seconds: float
) -> tuple[float, float, list[float], list[float], float]:
    """(host GiB·s over baseline, sandboxes' cgroup GiB·s, next-command
    latencies, all latencies, bytes reclaimed)."""
    cfg = NodeConfig.from_env(
        data_dir=WORK / ("on" if reclaim else "off"), images=IMAGES, node="rcl",
        scratch_size=4 * 2**30, swap_size=4 * 2**30,
        reclaim_after=RECLAIM_AFTER if reclaim else 0.0, reaper_interval=0.5,
    )  # fmt: skip
    fresh_dir(cfg.data_dir)
    nexts: list[float] = []
    every: list[float] = []
    async with corral.AsyncClient(config=cfg) as client:
        if not swap.active(cfg.data_dir / "swap"):
            raise SystemExit("the host refused a swap file: nothing to reclaim to")
        base = mem_used()
        reclaimed_before = metrics.MEMORY_RECLAIMED._value.get()
        boxes = []
        for i in range(sandboxes):
            s = await client.sandboxes.create(
                kind=kind, image=IMAGE, memory="256MiB", idle_timeout=None
            )
            await s.commands.run(RESIDENT)
            boxes.append(s)
            print(f"{'on' if reclaim else 'off'}: {i + 1}/{sandboxes} sandboxes", file=sys.stderr)
        await asyncio.sleep(3)  # the residents have built their state
        agent = client.service
        assert isinstance(agent, NodeAgent)
        cgroups = agent.parts.cgroups
        start = time.monotonic()
        end = start + seconds

        async def follow(k: int, s: corral.AsyncSandbox) -> None:
            rng = random.Random(k)
            while True:
                think = rng.expovariate(1 / THINK_MEAN)
                if time.monotonic() + think >= end:
                    return
                await asyncio.sleep(think)
                for j, cmd in enumerate(BURST):
                    t0 = time.perf_counter()
                    r = await s.commands.run(cmd, timeout=60)
                    dt = time.perf_counter() - t0
                    assert r.exit_code == 0, (cmd, r.stderr)
                    every.append(dt)
                    if j == 0:
                        nexts.append(dt)
                    await asyncio.sleep(0.3)

        host = cg = 0.0

        async def sample() -> None:
            nonlocal host, cg
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.5)
                now = time.monotonic()
                used = sum(cgroups.memory_usage(b.id) or 0 for b in boxes)
                host += max(0, mem_used() - base) * (now - last)
                cg += used * (now - last)
                last = now

        sampler = asyncio.create_task(sample())
        await asyncio.gather(*(follow(k, s) for k, s in enumerate(boxes)))
        sampler.cancel()
        reclaimed = metrics.MEMORY_RECLAIMED._value.get() - reclaimed_before
        for s in boxes:
            await s.close()
    return host / 2**30, cg / 2**30, nexts, every, reclaimed


def zswap_compressor() -> str:
    try:
        return (swap.ZSWAP / "compressor").read_text().strip()
    except OSError:
        return "no zswap"


HEADER = [
    "reclaim", "host GiB·s", "host MiB per sandbox (mean)", "cgroups GiB·s",
    "next command p50 (ms)", "next command p99 (ms)", "any command p50 (ms)",
    "any command p99 (ms)", "commands",
]  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kind", choices=["container", "microvm"], default="container")
    p.add_argument("--sandboxes", type=int, default=0, help="40 containers or 8 microVMs")
    p.add_argument("--seconds", type=float, default=120.0)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    vm = a.kind == "microvm"
    n = a.sandboxes or (8 if vm else 40)
    n, secs = (min(n, 4 if vm else 16), 60.0) if a.quick else (n, a.seconds)
    off = asyncio.run(phase(a.kind, False, n, secs))
    on = asyncio.run(phase(a.kind, True, n, secs))
    rows = []
    for name, r in (("off", off), ("on", on)):
        rows.append([
            name, f"{r[0]:.2f}", f"{r[0] * 1024 / n / secs:.1f}", f"{r[1]:.2f}",
            f"{pct([x * 1000 for x in r[2]], 50):.1f}", f"{pct([x * 1000 for x in r[2]], 99):.1f}",
            f"{pct([x * 1000 for x in r[3]], 50):.1f}", f"{pct([x * 1000 for x in r[3]], 99):.1f}",
            str(len(r[3])),
        ])  # fmt: skip
    saved_host = 1 - on[0] / off[0]
    saved_cg = 1 - on[1] / off[1]
    what = (
        f"{n} microVMs ({accelerator()}, debian-python, 256 MiB of guest memory, a "
        f"{NodeConfig().vm_tcg_cache_mib} MiB code cache), each with"
        if vm
        else f"{n} containers (debian-python, 256 MiB limit), each with"
    )
    sections = [
        f"{what} a resident Python process "
        "that imported json, decimal, email, http.client, xml.dom, sqlite3, asyncio, logging, "
        "argparse and unittest and holds 120,000 small dicts (a daemon started by a command "
        f"that ended). For {secs:.0f} s each follows a seeded agent trace: think (exponential, "
        f"mean {THINK_MEAN:.0f} s), then three commands 0.3 s apart (a Python one-liner, ls, "
        f"cat). `on`: reclaim_after {RECLAIM_AFTER:.0f} s, a 4 GiB swap file through zswap "
        f"({zswap_compressor()}); `off`: the same node and swap file, no reclaim. Memory is "
        "integrated over the trace: the host's (MemTotal - MemAvailable, less before the "
        "sandboxes; the zswap pool included) and the sandboxes' cgroups'"
        + (" (a VM's holds its QEMU: guest memory and the emulator's own)." if vm else "."),
        table(HEADER, rows),
        f"Saved with reclaim: **{saved_host:.1%}** of host memory over time "
        f"({saved_cg:.1%} of the sandboxes' own); {on[4] / 2**20:.0f} MiB reclaimed in all. "
        "The next command is the first of a burst, after a think time: with reclaim it "
        "usually finds its sandbox reclaimed and faults back what it touches (the shell, "
        "Python's libraries, from page cache or the lazy loader's chunk cache; the resident's "
        "heap stays out until it runs). DSec: 21.2% for VMs. Target (issue 20): >= 25%.",
    ]
    if vm:
        write_result("reclaim-microvm", "Memory back from idle microVMs", sections)
    else:
        write_result("reclaim", "Memory back from idle containers", sections)


if __name__ == "__main__":
    main()
