"""A DSec cell in simulation: the real gateway, placement and quota code in
front of simulated node agents and a real PostgreSQL (docs/cell-simulation.md).

    corral bench cellsim [--quick] [--nodes 160] [--per-node 3200]
        [--burst 32000] [--rate 5000] [--seconds 15] [--gateways 1,2,4]

Each cell is fresh (bench/sim/cell.py): PostgreSQL of its own, `--nodes`
simulated node agents heartbeating into it (bench/sim/node.py: no
sandboxes, a create answers after `--create-delay`), and `--gateways`
unmodified `corral serve --gateway` replicas. Phases:

- idle: what the cell costs doing nothing (heartbeats, the sweeps), taken
  out of the per-create CPU of the phases after it;
- an open loop: creates offered at `--rate` per second for `--seconds`,
  whatever the answers (latency counted from when each was due, so a lagging
  cell is not hidden); beyond `--max-in-flight` outstanding, a create is shed
  by the client and counted;
- a burst: creates at once, `--concurrency` in flight, spread over the
  replicas, each retried under its idempotency key while the gateway
  answers Unavailable (as create_many does); placement is read from the
  store after it; what is not done in its time limit is cut off.

Per replica count: idle, an open loop over unrelated projects, a burst of
`--sweep-burst` on one project chain. Then, with the replica count whose
open loop did best, the DSec burst (`--burst`, 32,000: DSec's largest
request) and an open loop, both on one chain (one job's creates).

This process is the load generator. CPU seconds of each part come from
/proc (PostgreSQL: the postmaster, its backends and the backends it reaped);
the machine's from /proc/stat, so a neighbour's load shows as "other".
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import math
import os
import secrets
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402
from bench.sim.cell import NODE_KEY, SimCell, cpu_delta  # noqa: E402
from bench.sim.report import (  # noqa: E402
    PARTS,
    Load,
    Measured,
    calls_line,
    cpu_row,
    row,
    statements_section,
    versions,
    waits_line,
)

import corral  # noqa: E402
from _common import table, write_result  # noqa: E402
from corral.api.http import HttpService  # noqa: E402
from corral.db import Database, connect  # noqa: E402

SPEC: dict[str, Any] = {"image": "debian-python:bookworm", "cpu": 0.25, "memory": "512MiB"}
SPREAD = 16  # independent projects, for the open loop without a shared quota row


def clients(cell: SimCell, keys: list[str], in_flight: int) -> list[corral.AsyncClient]:
    """SDK clients over every replica and key, each pool at most 64
    connections: httpx's pool does work per waiting request on every
    event, so one pool with hundreds waiting costs the load generator more
    CPU per create than the gateway spends (and httpx keeps only 20 alive
    by default: a connection beyond those is opened and closed per request)."""
    per = max(1, math.ceil(in_flight / len(cell.replicas) / len(keys) / 64))
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    return [
        corral.AsyncClient(
            transport=HttpService(
                g.url, api_key=key, transport=httpx.AsyncHTTPTransport(limits=limits)
            )
        )
        for _ in range(per)
        for key in keys
        for g in cell.replicas
    ]


def reason(message: str) -> str:
    """An error message, short enough for a table cell."""
    for known in ("deadlock detected", "couldn't get a connection", "quota exceeded"):
        if known in message:
            return known
    return message.split("\n", 1)[0][:60]


async def create(
    client: corral.AsyncClient, key: str, load: Load, due: float, retry_until: float
) -> None:
    pause = 0.1
    while True:
        try:
            sbx = await client.sandboxes.create(**SPEC, idempotency_key=key)
        except corral.Unavailable as exc:
            # What create_many does: the key makes a retry find what the
            # attempt that lost its answer made.
            load.why[reason(exc.message)] += 1
            if exc.details.get("retry") and time.perf_counter() + pause < retry_until:
                load.retries += 1
                await asyncio.sleep(pause)
                pause = min(pause * 2, 2.0)
                continue
            load.errors[exc.code] += 1
            return
        except corral.CorralError as exc:
            load.why[reason(exc.message)] += 1
            load.errors[exc.code] += 1
            return
        load.lat.append(time.perf_counter() - due)
        load.ids.append(sbx.id)
        return


async def burst(cs: list[corral.AsyncClient], n: int, concurrency: int, limit: float) -> Load:
    """`n` creates, `concurrency` at a time; what is not done in `limit`
    seconds is cancelled and counted as cut off (this machine is shared:
    a run must end)."""
    load, gate, tag = Load(offered=n), asyncio.Semaphore(concurrency), secrets.token_hex(4)
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        async with gate:
            due = time.perf_counter()
            await create(cs[i % len(cs)], f"b{tag}-{i}", load, due, due + 60)

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    await cut_off(set(tasks), limit, load)
    load.wall = time.perf_counter() - t0
    return load


async def cut_off(pending: set[asyncio.Task[None]], limit: float, load: Load) -> None:
    """Wait up to `limit` s for `pending`; cancel and count what is left."""
    if not pending:
        return
    _, late = await asyncio.wait(pending, timeout=limit)
    load.cut_off = len(late)
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)


async def open_loop(
    cs: list[corral.AsyncClient], rate: float, seconds: float, cap: int, drain: float
) -> Load:
    load, tag = Load(offered=int(rate * seconds)), secrets.token_hex(4)
    pending: set[asyncio.Task[None]] = set()
    t0 = time.perf_counter()
    sent = 0
    while (now := time.perf_counter() - t0) < seconds:
        due = min(int(now * rate) + 1, load.offered)
        while sent < due:
            if len(pending) >= cap:
                load.shed += due - sent
                sent = due
                break
            task = asyncio.create_task(
                create(cs[sent % len(cs)], f"o{tag}-{sent}", load, t0 + sent / rate, 0.0)
            )
            pending.add(task)
            task.add_done_callback(pending.discard)
            sent += 1
        await asyncio.sleep(0.002)
    load.shed += load.offered - sent
    await cut_off(set(pending), drain, load)
    load.wall = time.perf_counter() - t0
    return load


async def idle(seconds: float) -> Load:
    """Nothing asked: what the cell costs with no creates (heartbeats, the
    gateways' sweeps)."""
    await asyncio.sleep(seconds)
    return Load(offered=0, wall=seconds)


async def settle(cell: SimCell, limit: float = 15.0) -> None:
    """Until no create is still being placed (a burst cut off leaves some
    running in the gateways), so the next phase starts clean."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        left = cell.psql("SELECT COUNT(*) FROM sandboxes WHERE state = 'placing'")
        if int(left[0][0]) == 0:
            return
        await asyncio.sleep(0.5)


async def sample_waits(db: Database, out: collections.Counter[str], n: list[int]) -> None:
    """What PostgreSQL's busy sessions wait on, four times a second."""
    while True:
        async with db.transaction() as tx:
            rows = await tx.fetchall(
                "SELECT state, COALESCE(wait_event_type || ':' || wait_event, 'CPU')"
                " FROM pg_stat_activity WHERE datname = 'corral' AND pid <> pg_backend_pid()"
                " AND backend_type = 'client backend' AND state <> 'idle'"
            )
        for state, wait in rows:
            out[f"{wait} ({state})" if state != "active" else str(wait)] += 1
        n[0] += 1
        await asyncio.sleep(0.25)


async def sim_calls(cell: SimCell) -> dict[str, int]:
    """The simulated nodes' request counts, summed over nodes."""
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {NODE_KEY}"}) as http:
        doc = (await http.get(f"http://127.0.0.1:{cell.sim_port}/_sim/stats")).json()
    total: collections.Counter[str] = collections.Counter()
    for node in doc.values():
        total.update(node["calls"])
    return dict(total)


async def measured(cell: SimCell, db: Database, run: Any) -> Measured:
    if cell.statements:
        cell.psql("SELECT pg_stat_statements_reset()")
    commits_sql = "SELECT xact_commit FROM pg_stat_database WHERE datname = 'corral'"
    commits0, calls0 = int(cell.psql(commits_sql)[0][0]), await sim_calls(cell)
    deadlocks0 = cell.server_log("deadlock detected")
    waits: collections.Counter[str] = collections.Counter()
    samples = [0]
    sampler = asyncio.create_task(sample_waits(db, waits, samples))
    before = cell.cpu()
    try:
        load = await run
    finally:
        after = cell.cpu()
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
    wall, parts, machine = cpu_delta(before, after)
    calls1 = await sim_calls(cell)
    calls = {k: v - calls0.get(k, 0) for k, v in calls1.items() if v - calls0.get(k, 0)}
    statements = []
    if cell.statements:
        statements = cell.psql(
            "SELECT calls, round(total_exec_time::numeric, 1), regexp_replace(query, '\\s+', ' ',"
            " 'g') FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE"
            " datname = 'corral') ORDER BY total_exec_time DESC LIMIT 8"
        )
    commits = int(cell.psql(commits_sql)[0][0]) - commits0
    deadlocks = cell.server_log("deadlock detected") - deadlocks0
    return Measured(
        load, wall, parts, machine, commits, statements, waits, samples[0], calls, deadlocks
    )


def placement(cell: SimCell) -> dict[str, float]:
    """Each node's load (every project's ready sandboxes): placement
    balances what nodes hold, not one project's share of it."""
    rows = cell.psql("SELECT node, COUNT(*) FROM sandboxes WHERE state = 'ready' GROUP BY node")
    counts = {name: int(n) for name, n in rows}
    loads = [counts.get(f"n{i:03d}", 0) for i in range(cell.nodes)]
    mean = sum(loads) / len(loads)
    return {
        "mean": mean,
        "max": max(loads),
        "min": min(loads),
        "stdev": statistics.pstdev(loads),
        "max/mean": max(loads) / mean if mean else float("nan"),
    }


@dataclass(frozen=True)
class Phase:
    kind: str  # "idle", "burst" or "open"
    n: float  # seconds (idle), creates (burst) or creates per second (open)
    spread: bool = False  # over SPREAD independent projects, not one chain

    def label(self) -> str:
        if self.kind == "idle":
            return f"idle {self.n:g} s"
        who = f"{SPREAD} projects" if self.spread else "one chain"
        what = f"burst {int(self.n):,}" if self.kind == "burst" else f"open loop {self.n:g}/s"
        return f"{what} ({who})"


async def run_cell(
    args: argparse.Namespace, gateways: int, phases: list[Phase], out: dict[str, list[Any]]
) -> float:
    """A fresh cell with `gateways` replicas, the phases run on it in turn;
    returns the creates/s of its first open loop."""
    root = Path(tempfile.mkdtemp(prefix="cellsim-", dir="/tmp"))
    cell = SimCell(
        root, nodes=args.nodes, per_node=args.per_node, gateways=gateways,
        create_delay=args.create_delay, statements=True,
    )  # fmt: skip
    rate = 0.0
    try:
        t0 = time.perf_counter()
        cell.start()
        print(f"[{gateways} gateways] cell up in {time.perf_counter() - t0:.1f} s", flush=True)
        # DSec's request is one job's: a job in a team in an org, so every
        # create charges the same three project rows.
        cell.project("org")
        cell.project("team", parent="org")
        chain = [cell.project("job", parent="team")]
        spread = [cell.project(f"p{i:02d}") for i in range(SPREAD)]
        db = await connect(cell.state)
        pools: dict[bool, list[corral.AsyncClient]] = {}
        idle_rate: dict[str, float] = {}
        try:
            for ph in phases:
                if ph.spread not in pools:
                    keys = spread if ph.spread else chain
                    pools[ph.spread] = clients(
                        cell, keys, max(args.concurrency, args.max_in_flight)
                    )
                    for c in pools[ph.spread]:
                        await c.open()
                cs = pools[ph.spread]
                if ph.kind == "idle":
                    run = idle(ph.n)
                elif ph.kind == "burst":
                    limit = args.phase_timeout if ph.n == args.burst else args.sweep_timeout
                    run = burst(cs, int(ph.n), args.concurrency, limit)
                else:
                    drain = min(15.0, args.seconds)
                    run = open_loop(cs, ph.n, args.seconds, args.max_in_flight, drain)
                m = await measured(cell, db, run)
                if ph.kind == "idle":
                    idle_rate = {k: m.cpu[k] / m.wall for k in PARTS}
                out["cpu"].append(cpu_row(gateways, ph.label(), m, idle_rate))
                out["rows"].append(row(gateways, ph.label(), m))
                why = ", ".join(f"{k} {v}" for k, v in m.load.why.most_common(3)) or "-"
                out["waits"].append([str(gateways), ph.label(), waits_line(m), why, calls_line(m)])
                out["statements"].append((gateways, ph.label(), m))
                print(out["rows"][-1], flush=True)
                if ph.kind == "open" and not rate:
                    rate = len(m.load.ids) / m.wall
                if ph.kind == "burst" and not ph.spread:
                    p = placement(cell)
                    dup = len(m.load.ids) - len(set(m.load.ids))
                    out["placement"].append(
                        [str(gateways), f"{args.nodes}", f"{len(m.load.ids):,}",
                         f"{p['mean']:.1f}", str(int(p["max"])), str(int(p["min"])),
                         f"{p['stdev']:.1f}", f"{p['max/mean']:.2f}", str(dup),
                         str(m.load.retries)]
                    )  # fmt: skip
                    print(out["placement"][-1], flush=True)
                if ph.kind == "burst":
                    await settle(cell, min(15.0, 2 * args.seconds))
        finally:
            for cs in pools.values():
                for c in cs:
                    await c.aclose()
            await db.aclose()
    finally:
        cell.stop()
        cell.remove()
    return rate


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a small cell, in under a minute")
    p.add_argument("--nodes", type=int, default=160)
    p.add_argument("--per-node", type=int, default=3200)
    p.add_argument("--burst", type=int, default=32000, help="the DSec burst, on the best replicas")
    p.add_argument("--sweep-burst", type=int, default=1000, help="burst of each replica count")
    p.add_argument("--concurrency", type=int, default=256, help="burst creates in flight")
    p.add_argument("--rate", type=float, default=5000, help="open loop: creates offered per s")
    p.add_argument("--seconds", type=float, default=15, help="open loop: how long")
    p.add_argument("--max-in-flight", type=int, default=256, help="open loop: client's cap")
    p.add_argument("--gateways", default="1,2,4", help="replica counts, a cell each")
    p.add_argument("--burst-gateways", type=int, help="replicas for the DSec burst (default: best)")
    p.add_argument("--phase-timeout", type=float, default=200, help="DSec burst's limit, s")
    p.add_argument("--sweep-timeout", type=float, default=90, help="a sweep burst's limit, s")
    p.add_argument("--create-delay", type=float, default=0.01, help="a node's create, s")
    p.add_argument("--out", default="cellsim", help="results file under bench/results")
    if "--quick" in argv:
        p.set_defaults(
            nodes=16, burst=400, sweep_burst=150, seconds=2, gateways="1,2", phase_timeout=8,
            sweep_timeout=5, out="cellsim-quick",
        )  # fmt: skip
    return p.parse_args(argv)


async def main(argv: list[str]) -> None:
    args = parse(argv)
    if shutil.which("runuser") is None or os.geteuid() != 0:
        raise SystemExit("cellsim runs PostgreSQL as its own user: run it as root")
    # SIGTERM (a timeout, an impatient operator) unwinds like Ctrl-C, so
    # every cell's finally stops its processes and PostgreSQL.
    me = asyncio.current_task()
    assert me is not None
    with contextlib.suppress(ValueError, RuntimeError):  # not the main thread: `corral bench`
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, me.cancel)
    out: dict[str, list[Any]] = {
        "rows": [], "cpu": [], "placement": [], "waits": [], "statements": []
    }  # fmt: skip
    started = time.perf_counter()
    # The sweep's open loop spreads over unrelated projects, and runs first:
    # what replicas add, apart from the one chain's quota rows that every
    # create of a job updates (the bursts, and the DSec cell).
    idle_s = min(5.0, args.seconds)
    sweep = [
        Phase("idle", idle_s), Phase("open", args.rate, spread=True),
        Phase("burst", args.sweep_burst),
    ]  # fmt: skip
    rates: dict[int, float] = {}
    for g in map(int, args.gateways.split(",")):
        rates[g] = await run_cell(args, g, sweep, out)
    best = args.burst_gateways or max(rates, key=lambda g: (rates[g], -g))
    dsec = [Phase("idle", idle_s), Phase("burst", args.burst), Phase("open", args.rate)]
    await run_cell(args, best, dsec, out)
    took = time.perf_counter() - started
    header = [
        "gateways", "phase", "offered", "ready", "errors", "wall s", "creates/s",
        "per replica", "p50 ms", "p99 ms", "PG deadlocks", "saturates",
    ]  # fmt: skip
    cpu_header = [
        "gateways", "phase", "CPU s: PG / gateways / sim nodes / loadgen / other",
        "cores: PG / gateways / sim / loadgen", "ms per create beyond idle: same order",
        "creates per PG CPU-s", "creates per gateway CPU-s", "PG commits/s",
        "PG commits per create",
    ]  # fmt: skip
    placement_header = [
        "gateways", "nodes", "burst ready", "node load: mean", "max", "min", "stdev", "max/mean",
        "duplicate ids", "retries",
    ]  # fmt: skip
    waits_header = ["gateways", "phase", "busy sessions by wait", "gateway errors", "node calls"]
    entries = out["statements"]
    shown = [e for e in entries if e[0] == entries[0][0] and "open" in e[1]][:1] + entries[-3:-1]
    sections = [
        f"Versions: {versions()}.\n\nCell: {args.nodes} simulated nodes x {args.per_node:,} "
        f"sandboxes, a create takes {args.create_delay * 1000:g} ms on a node. Projects: "
        f"one chain three levels deep (org > team > job, a DSec job), or {SPREAD} unrelated "
        f"ones. Each replica count gets a fresh cell: {idle_s:g} s idle, an open loop over "
        f"the {SPREAD} projects, a burst of {args.sweep_burst:,} on the chain (cut at "
        f"{args.sweep_timeout:g} s). Then the DSec burst of {args.burst:,} on the chain, on a "
        f"fresh cell with {best} replica(s) (the best open loop; cut at "
        f"{args.phase_timeout:g} s), then an open loop on the chain. Bursts at concurrency "
        f"{args.concurrency}, retried under their keys while the gateway answers "
        f"Unavailable; open loops {args.rate:g}/s offered for {args.seconds:g} s, at most "
        f"{args.max_in_flight} in flight (beyond: shed by the client). Whole run "
        f"{took:.0f} s. CPU 'other': the rest of the machine over the same interval "
        "(another user's work included: this machine is shared).",
        "## Creates\n\n" + table(header, out["rows"]),
        "## CPU\n\n" + table(cpu_header, out["cpu"]),
        "## Placement after the bursts (sandboxes per node, from the store)\n\n"
        + table(placement_header, out["placement"]),
        "## What PostgreSQL's sessions were doing (mean sessions, sampled 4/s), the "
        "gateways' errors (retried under their keys) and what the nodes were asked\n\n"
        + table(waits_header, out["waits"]),
        "## Statements (pg_stat_statements; execution time excludes the commit's WAL "
        "flush)\n\n" + statements_section(shown),
    ]
    path = write_result(
        args.out, "A DSec cell in simulation: gateways, placement, quotas", sections
    )
    print(f"wrote {path} in {took:.0f} s")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
