"""Issue 23's paths, measured: exec and file traffic through the gateway vs
on a direct path (a token the gateway signed, straight to the node), next
to the node agent's own endpoint with the nodes' key (the peer: no gateway,
no token); a create placed at home vs spilled to a burst target; and a
node's first create of an image it lacks (fetched from the shared blob
store) vs its next ones.

    corral bench cluster_paths [--n 300] [--quick]

Every cluster is processes on this one machine (tests/framework/cluster.py):
the gateway, the node agents, PostgreSQL and this load generator share its
2 cores, so the CPU columns say what each path costs, not how far it scales.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from tests.framework.cluster import Cluster  # noqa: E402

import corral  # noqa: E402
from _common import IMAGE, IMAGES, fresh_dir, median, pct, table, timed, write_result  # noqa: E402
from cluster import cpu_seconds  # noqa: E402

WORK = Path("/var/lib/corral-paths")
SPEC: dict[str, Any] = {"image": IMAGE, "memory": "64MiB", "cpu": 0.25}
PAYLOAD = secrets.token_bytes(64 * 1024)


def ms(values: list[float]) -> tuple[str, str]:
    return f"{median(values) * 1000:.2f}", f"{pct(values, 99) * 1000:.2f}"


async def rate(seconds: float, width: int, op: Callable[[], Awaitable[object]]) -> float:
    """Operations per second with `width` in flight."""
    done = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await op()
            done += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(width)))
    return done / (time.perf_counter() - t0)


async def paths(n: int) -> list[list[str]]:
    cluster = Cluster(fresh_dir(WORK) / "paths", nodes=1, prefix="p", net_offset=20)
    rows: list[list[str]] = []
    try:
        cluster.start()
        assert cluster.gateway is not None and cluster.gateway.proc is not None
        gw_pid, node_pid = cluster.gateway.proc.pid, cluster.nodes[0].proc.pid  # type: ignore[union-attr]
        key = cluster.project("bench")
        async with cluster.client(key) as c, cluster.node_client(cluster.nodes[0], tcp=True) as nc:
            sbx = await c.sandboxes.create(**SPEC)
            fast = await sbx.direct(ttl=3600)
            peer = await nc.sandboxes.get(sbx.id)
            handles = [("gateway", sbx), ("direct token", fast), ("node, its own key", peer)]
            for label, h in handles:
                await h.commands.run("true")  # warm connections
                cpu0 = cpu_seconds([gw_pid]), cpu_seconds([node_pid])
                exec_t = await timed(n, lambda h=h: h.commands.run("true"))  # type: ignore[misc]
                cpu1 = cpu_seconds([gw_pid]), cpu_seconds([node_pid])

                async def files(h: corral.AsyncSandbox = h) -> None:
                    await h.files.write("/tmp/p", PAYLOAD)
                    await h.files.read("/tmp/p")

                file_t = await timed(n // 2, files)
                ops = await rate(5.0, 16, lambda h=h: h.commands.run("true"))  # type: ignore[misc]
                rows.append(
                    [
                        label,
                        *ms(exec_t),
                        *ms(file_t),
                        f"{ops:.0f}",
                        f"{(cpu1[0] - cpu0[0]) / n * 1000:.2f}",
                        f"{(cpu1[1] - cpu0[1]) / n * 1000:.2f}",
                    ]
                )
            await sbx.close()
    finally:
        cluster.stop()
    return rows


async def bursting(n: int) -> list[list[str]]:
    away = Cluster(fresh_dir(WORK) / "away", nodes=1, prefix="w", net_offset=21)
    home: Cluster | None = None
    try:
        away.start()
        assert away.gateway is not None
        targets = WORK / "burst.json"
        burst_key = away.project("burst")
        targets.write_text(
            json.dumps([{"name": "away", "url": away.gateway.url, "api_key": burst_key, "cap": n}])
        )
        home = Cluster(
            WORK / "home", nodes=1, prefix="h", net_offset=22,
            node_config={"max_sandboxes": n // 2},
            gateway_args=["--burst-targets", str(targets)],
        )  # fmt: skip
        home.start()
        key = home.project("job")
        by_where: dict[str, list[float]] = {"home": [], "away": []}
        made = []
        async with home.client(key) as c:
            for _ in range(n):
                t0 = time.perf_counter()
                s = await c.sandboxes.create(**SPEC)
                took = time.perf_counter() - t0
                by_where["away" if s.id.startswith("away-") else "home"].append(took)
                made.append(s)
                await asyncio.sleep(0.3)  # each create sees the last one's heartbeat
            exec_home = [x for x in made if not x.id.startswith("away-")][:1]
            exec_away = [x for x in made if x.id.startswith("away-")][:1]
            ex = {
                "home": await timed(50, lambda: exec_home[0].commands.run("true")),
                "away": await timed(50, lambda: exec_away[0].commands.run("true")),
            }
            await asyncio.gather(*(s.close() for s in made))
        rows = []
        for where in ("home", "away"):
            t = by_where[where]
            rows.append([where, str(len(t)), *ms(t), *ms(ex[where])])
        return rows
    finally:
        if home is not None:
            home.stop()
        away.stop()


async def first_use(warm: int) -> list[list[str]]:
    cluster = Cluster(
        fresh_dir(WORK) / "fetch", nodes=2, prefix="f", net_offset=23,
        node_config={"images": None, "image_sources": [str(IMAGES)]},
    )  # fmt: skip
    try:
        cluster.start()
        key = cluster.project("fetch")
        cold: list[float] = []
        hot: list[float] = []
        async with cluster.client(key) as c:
            made: list[corral.AsyncSandbox] = []
            for _ in range(warm + 2):
                t0 = time.perf_counter()
                s = await c.sandboxes.create(**SPEC)
                took = time.perf_counter() - t0
                node = s.id.split("-")[0]
                first = not any(m.id.startswith(node + "-") for m in made)
                (cold if first else hot).append(took)
                made.append(s)
                if first:
                    await asyncio.sleep(1.2)  # its layers reach placement by heartbeat
            await asyncio.gather(*(s.close() for s in made))
        return [
            ["first on its node (fetches the manifests, then reads lazily)", str(len(cold)),
             *ms(cold)],
            ["next ones (the image is held)", str(len(hot)), *ms(hot)],
        ]  # fmt: skip
    finally:
        cluster.stop()


async def main(n: int, quick: bool) -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    path_rows = await paths(60 if quick else n)
    burst_rows = await bursting(8 if quick else 24)
    fetch_rows = await first_use(5 if quick else 20)
    sections = [
        "## Gateway vs direct path\n\n"
        "One sandbox on one node. *gateway*: every call through `corral serve --gateway` "
        "(row and owner checked, forwarded with the nodes' key); *direct token*: "
        "`sbx.direct()`, a token the gateway signed, sent straight to the node, which "
        "checks it alone (HMAC, sandbox, expiry; no state store); *node, its own key*: the "
        "node agent's endpoint with the nodes' key, the floor. Exec: `true`, sequential; "
        "files: write then read 64 KiB; rate: `true` with 16 in flight for 5 s. CPU: ms "
        "per exec spent by the gateway process and by the node agent process.\n\n"
        + table(
            [
                "path",
                "exec p50 (ms)",
                "exec p99 (ms)",
                "files p50 (ms)",
                "files p99 (ms)",
                "exec/s at 16",
                "gateway CPU/exec (ms)",
                "node CPU/exec (ms)",
            ],
            path_rows,
        ),
        "## A create at home vs spilled to a burst target\n\n"
        "A home cluster of one node (half the creates' worth of slots) whose gateway spills "
        "to a second cluster's gateway past 80% use. Create latency is the caller's, "
        "through the home gateway; exec is `true` on one sandbox of each, through the home "
        "gateway (a burst sandbox's calls take one more gateway hop).\n\n"
        + table(
            [
                "placed",
                "creates",
                "create p50 (ms)",
                "create p99 (ms)",
                "exec p50 (ms)",
                "exec p99 (ms)",
            ],
            burst_rows,
        ),
        "## An image a node lacks, fetched on first use\n\n"
        "Two nodes with empty layer stores and the machine's image store as their blob "
        "source. A node's first create of the image copies its tag and manifests and "
        "mounts its metadata; the data comes chunk by chunk as the sandbox reads it.\n\n"
        + table(["create", "n", "p50 (ms)", "p99 (ms)"], fetch_rows),
    ]
    print(write_result("cluster_paths", "Cluster paths: direct, burst, first use", sections))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    asyncio.run(main(a.n, a.quick))
