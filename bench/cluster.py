"""The control plane, measured: creation through the gateway vs straight to
node agents at 1, 2 and 3 nodes; a burst of 2,000 over 3 nodes; a node agent
killed in the middle of a burst.

    corral bench cluster [--count 400] [--burst 2000]

Every cluster here is processes on this one machine (tests/framework/cluster.py's
Cluster: a PostgreSQL of its own, `corral serve --state` node agents,
a `corral serve --gateway`), the same parts `corral cluster up` runs under
Ray. The nodes share the machine's 2 cores, so more nodes add no CPU: the
per-node figures show what the gateway costs, not how a real cluster scales.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from tests.framework.cluster import Cluster as ProcessCluster  # noqa: E402

import corral  # noqa: E402
from _common import IMAGE, fresh_dir, leak_counts, median, pct, table, write_result  # noqa: E402

WORK = Path("/var/lib/corral-cluster")
SPEC = {"image": IMAGE, "memory": "32MiB", "disk": "64MiB", "pids": 64, "cpu": 0.1}
CONCURRENCY = 32
QUICK = "--quick" in sys.argv
ROUNDS = 1 if QUICK else 3


async def timed_burst(
    clients: list[corral.AsyncClient], n: int, on_ready: object = None
) -> tuple[list[float], float, list[object]]:
    """create_many of n split over `clients` (one per node, or the gateway),
    CONCURRENCY in flight in total. Per-item seconds to ready, the wall."""
    t0 = time.perf_counter()
    when: list[float] = []
    key = secrets.token_hex(6)

    def ready(i: int, r: str | corral.CorralError) -> None:
        if isinstance(r, str):
            when.append(time.perf_counter() - t0)
        if callable(on_ready):
            on_ready(i, r)

    shares = [n // len(clients) + (i < n % len(clients)) for i in range(len(clients))]
    outs = await asyncio.gather(
        *(
            c.sandboxes.create_many(
                SPEC,
                share,
                concurrency=max(1, CONCURRENCY // len(clients)),
                key=f"{key}-{i}",
                on_ready=ready,
            )
            for i, (c, share) in enumerate(zip(clients, shares, strict=True))
        )
    )
    return when, time.perf_counter() - t0, [r for out in outs for r in out]


async def close_all(results: Sequence[object]) -> None:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(s: corral.AsyncSandbox) -> None:
        async with gate:
            try:
                await s.close()
            except corral.CorralError:
                pass  # lost with its node: closing it there is the node's business

    await asyncio.gather(*(one(s) for s in results if isinstance(s, corral.AsyncSandbox)))


async def held(cluster: ProcessCluster) -> dict[str, int]:
    out = {}
    for srv in cluster.nodes:
        if srv.proc is None or srv.proc.poll() is not None:
            continue
        async with cluster.node_client(srv) as c:
            boxes = await c.sandboxes.list()
            out[srv.config.node] = sum("corral.key" in s.info.labels for s in boxes)
    return out


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of these processes so far (clock ticks to seconds)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def postgres_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-u", "postgres"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def failures(results: list[object]) -> int:
    return sum(not isinstance(r, corral.AsyncSandbox) for r in results)


async def scaling(count: int, cpu_rows: list[list[str]]) -> list[list[str]]:
    rows = []
    for k in (1,) if QUICK else (1, 2, 3):
        cluster = ProcessCluster(fresh_dir(WORK) / "pc", nodes=k, node_timeout=10)
        cluster.start()
        try:
            key = cluster.project(f"bench{k}")
            direct = [cluster.node_client(srv, tcp=True) for srv in cluster.nodes]
            gateway = cluster.client(key)
            for c in (*direct, gateway):
                await c.__aenter__()
            # Warm both paths once (layers in the page cache, pools).
            _, _, warm = await timed_burst(direct, 3 * k)
            await close_all(warm)
            _, _, warm = await timed_burst([gateway], 3 * k)
            await close_all(warm)
            assert cluster.gateway is not None and cluster.gateway.proc is not None
            parts = {
                "gateway": [cluster.gateway.proc.pid],
                "postgres": postgres_pids(),
                "nodes": [srv.proc.pid for srv in cluster.nodes if srv.proc is not None],
            }
            rates: dict[str, list[float]] = {"direct": [], "gateway": []}
            lat: dict[str, list[float]] = {"direct": [], "gateway": []}
            fails = {"direct": 0, "gateway": 0}
            cpu: dict[str, dict[str, float]] = {
                "direct": dict.fromkeys(parts, 0.0),
                "gateway": dict.fromkeys(parts, 0.0),
            }
            # Rounds alternate the two paths, so a slow spell of this shared
            # machine falls on both; the rate reported is the median round.
            for _ in range(ROUNDS):
                for name, clients in (("direct", direct), ("gateway", [gateway])):
                    before = {part: cpu_seconds(pids) for part, pids in parts.items()}
                    when, wall, out = await timed_burst(clients, count)
                    for part, pids in parts.items():
                        cpu[name][part] += (cpu_seconds(pids) - before[part]) / count / ROUNDS
                    rates[name].append(count / wall)
                    lat[name] += when
                    fails[name] += failures(out)
                    print(f"{k} nodes {name}: {count / wall:.0f}/s", cpu[name], flush=True)
                    await close_all(out)
            for name in ("direct", "gateway"):
                cpu_rows.append(
                    [str(k), name]
                    + [f"{cpu[name][p] * 1000:.1f}" for p in ("nodes", "gateway", "postgres")]
                )
            result = {
                name: (median(rates[name]), median(lat[name]), pct(lat[name], 99), fails[name])
                for name in rates
            }
            for c in (*direct, gateway):
                await c.__aexit__(None, None, None)
            d, g = result["direct"], result["gateway"]
            rows.append(
                [
                    str(k),
                    str(count),
                    f"{d[0]:.0f}",
                    f"{g[0]:.0f}",
                    f"{g[0] / d[0]:.2f}",
                    f"{g[0] / k:.0f}",
                    f"{d[1] * 1000:.0f} / {g[1] * 1000:.0f}",
                    f"{d[2] * 1000:.0f} / {g[2] * 1000:.0f}",
                    f"{d[3]} / {g[3]}",
                ]
            )
        finally:
            cluster.stop()
    return rows


async def big_burst(n: int) -> tuple[list[list[str]], list[list[str]]]:
    cluster = ProcessCluster(fresh_dir(WORK) / "pc", nodes=3, node_timeout=5)
    cluster.start()
    try:
        key = cluster.project("burst")
        async with cluster.client(key) as gw:
            when, wall, out = await timed_burst([gw], n)
            on_nodes = await held(cluster)
            ok = n - failures(out)
            ids = [r.id for r in out if isinstance(r, corral.AsyncSandbox)]
            row = [
                str(n),
                f"{wall:.1f}",
                f"{n / wall:.0f}",
                f"{median(when) * 1000:.0f}",
                f"{pct(when, 99) * 1000:.0f}",
                str(failures(out)),
                str(sum(on_nodes.values()) - ok + (len(ids) - len(set(ids)))),
                ", ".join(f"{k}: {v}" for k, v in sorted(on_nodes.items())),
            ]
            print(row, flush=True)
            t0 = time.perf_counter()
            await close_all(out)
            closed = time.perf_counter() - t0
        return [row], [[str(n), f"{closed:.1f}", f"{n / closed:.0f}"]]
    finally:
        cluster.stop()


async def killed_node(n: int) -> list[list[str]]:
    """SIGKILL one node agent a quarter of the way into a burst; restart it."""
    cluster = ProcessCluster(fresh_dir(WORK) / "pc", nodes=3, node_timeout=5)
    cluster.start()
    rows: list[list[str]] = []
    try:
        key = cluster.project("kill")
        victim = cluster.nodes[1]
        killed_at: list[float] = []
        done = 0

        def maybe_kill(_i: int, _r: object) -> None:
            nonlocal done
            done += 1
            if not killed_at and done >= n // 4:
                killed_at.append(time.perf_counter())
                assert victim.proc is not None
                victim.proc.kill()

        async with cluster.client(key) as gw:
            _, wall, out = await timed_burst([gw], n, on_ready=maybe_kill)
            ok = [r for r in out if isinstance(r, corral.AsyncSandbox)]
            on_victim = [s for s in ok if s.id.startswith(victim.config.node + "-")]
            kinds = sorted({type(r).__name__ for r in out if isinstance(r, corral.CorralError)})
            rows.append(
                [
                    "burst with k1 killed after a quarter",
                    f"{len(ok)}/{n} ready in {wall:.1f} s; {failures(out)} failed "
                    f"{'(' + ', '.join(kinds) + ')' if kinds else ''}; {len(on_victim)} of "
                    "the ready ones are on k1",
                ]
            )
            # The client's view of a sandbox on the dead node, until it is lost.
            probe = on_victim[0] if on_victim else None
            seen: list[str] = []
            while probe is not None:
                try:
                    await probe.refresh()
                    seen.append("ok")
                except corral.SandboxLost:
                    rows.append(
                        [
                            "a ready sandbox on k1",
                            f"SandboxLost {time.perf_counter() - killed_at[0]:.1f} s after the "
                            "kill (node timeout 5 s); Unavailable before that",
                        ]
                    )
                    break
                except corral.Unavailable:
                    seen.append("unavailable")
                await asyncio.sleep(0.2)
            used = cluster.used("kill")[0]
            rows.append(["quota held after the loss", f"{used} (= {len(ok) - len(on_victim)})"])
            # k1 comes back: it recovers its sandboxes, finds them written
            # off, and closes them (reconcile).
            victim.server.start()
            t0 = time.perf_counter()
            while (await held(cluster)).get(victim.config.node, 0) > 0:
                await asyncio.sleep(0.5)
                if time.perf_counter() - t0 > 120:
                    break
            rows.append(
                [
                    "k1 restarted",
                    f"its {len(on_victim)} written-off sandboxes closed on it "
                    f"{time.perf_counter() - t0:.1f} s after its restart; "
                    f"{(await held(cluster)).get(victim.config.node, 0)} left",
                ]
            )
            await close_all(ok)
            rows.append(
                [
                    "after closing everything",
                    f"rows {cluster.rows()}; quota in use {cluster.used('kill')}; on nodes "
                    f"{await held(cluster)}",
                ]
            )
    finally:
        cluster.stop()
    return rows


async def main(count: int, n: int, quick: bool) -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    before = leak_counts(WORK)
    cpu_rows: list[list[str]] = []
    scale = await scaling(count, cpu_rows)
    if quick:
        return
    burst_rows, close_rows = await big_burst(n)
    kill_rows = await killed_node(max(400, n // 4))
    after = leak_counts(WORK)
    sections = [
        "## Gateway vs direct, at 1, 2 and 3 node agents\n\n"
        f"{count} sandboxes per run, {CONCURRENCY} creates in flight in total, {ROUNDS} rounds "
        "alternating the two paths (rates: the median round; latencies: all rounds). *Direct*: the "
        "client splits the burst evenly over the node agents' own HTTP endpoints (what a "
        "client that knew where to go would do). *Gateway*: one `create_many` through "
        "`corral serve --gateway`, which writes each sandbox's row to PostgreSQL (quota "
        "charged in the same transaction), places it (power of two choices), asks the node "
        "and records the result: 2 transactions per sandbox. All nodes share this machine's "
        "2 cores.\n\n"
        + table(
            [
                "nodes",
                "sandboxes",
                "direct (per s)",
                "gateway (per s)",
                "gateway / direct",
                "gateway per node (per s)",
                "p50 ready (ms) direct / gw",
                "p99 ready (ms) direct / gw",
                "failures direct / gw",
            ],
            scale,
        )
        + "\n\nWhere the CPU goes, per sandbox created (ms of CPU, from /proc/<pid>/stat; "
        "node agents' own processes, not their sandboxes'). On a cluster the gateway and "
        "PostgreSQL run on their own cores; here they take them from the nodes, which is "
        "the whole of the gap above.\n\n"
        + table(["nodes", "path", "node agents", "gateway", "PostgreSQL"], cpu_rows),
        f"## A burst of {n} over 3 node agents, through the gateway\n\n"
        "Latency is from the start of the burst to each sandbox's readiness. Duplicates: "
        "sandboxes the nodes hold beyond one per successful item, plus ids returned twice.\n\n"
        + table(
            [
                "sandboxes",
                "all ready (s)",
                "per s",
                "ready p50 (ms)",
                "ready p99 (ms)",
                "failures",
                "duplicates",
                "per node",
            ],
            burst_rows,
        )
        + "\n\n"
        + table(["closed", "seconds", "per s"], close_rows),
        "## A node agent killed mid-burst\n\n"
        "SIGKILL of node agent k1 a quarter of the way into a burst through the gateway. "
        "Creates in flight to it fail over to the other nodes; sandboxes already ready on it "
        "are written off (SandboxLost, quota released) once it has been silent for the node "
        "timeout, never recreated behind the caller's back.\n\n"
        + table(["step", "what the client sees / what is left"], kill_rows),
        "## Leftovers (host-wide, before vs after)\n\n"
        + table(["object", "before", "after"], [[k, str(before[k]), str(after[k])] for k in after]),
    ]
    path = write_result("cluster", "Control plane: gateway, bursts, a killed node", sections)
    print(f"wrote {path}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=400)
    ap.add_argument("--burst", type=int, default=2000)
    ap.add_argument("--quick", action="store_true", help="gateway vs direct only; no table")
    args = ap.parse_args()
    asyncio.run(main(args.count, args.burst, args.quick))
