"""Bursts: create_many of many lightweight sandboxes on one node, embedded
and through `corral serve` in the same run (the HTTP API's overhead), with
a retry of the whole burst (idempotency: nothing made twice) and a server
killed mid-burst (what the client sees; what is left after recovery).

    corral bench burst [--count 2000]

A multi-node gateway comparison belongs to the cluster work (issue 6):
this measures the node agent a gateway will route to.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corral
from _common import IMAGE, IMAGES, leak_counts, median, pct, table, write_result
from corral.config import NodeConfig

DATA = Path("/var/lib/corral-burst")
SPEC = {"image": IMAGE, "memory": "32MiB", "disk": "64MiB", "pids": 64, "labels": {"b": "1"}}


class Serve:
    def __init__(self) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.sock = DATA / "serve.sock"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.sock.unlink(missing_ok=True)
        env = dict(os.environ, CORRAL_NODE="burst", CORRAL_IMAGES=str(IMAGES))
        argv = [sys.executable, "-m", "corral.cli.main", "--data-dir", str(DATA), "serve"]
        argv += ["--port", str(self.port), "--socket", str(self.sock), "--log-level", "warning"]
        self.proc = subprocess.Popen(argv, env=env)
        while not self.sock.exists():
            time.sleep(0.05)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(60)


async def burst(
    client: corral.AsyncClient, n: int, key: str, kill_after: int = 0, kill: Serve | None = None
) -> tuple[list[float], float, list[object]]:
    """Per-item seconds from the start to ready, the wall, the results."""
    t0 = time.perf_counter()
    when: list[float] = []

    def ready(_i: int, r: str | corral.CorralError) -> None:
        if isinstance(r, str):
            when.append(time.perf_counter() - t0)
            if kill is not None and len(when) == kill_after:
                kill.kill()

    out = await client.sandboxes.create_many(SPEC, n, concurrency=32, key=key, on_ready=ready)
    return when, time.perf_counter() - t0, list(out)


async def close_all(client: corral.AsyncClient) -> float:
    t0 = time.perf_counter()
    boxes = await client.sandboxes.list(labels={"b": "1"})
    gate = asyncio.Semaphore(32)

    async def one(s: corral.AsyncSandbox) -> None:
        async with gate:
            await s.close()

    await asyncio.gather(*(one(s) for s in boxes))
    return time.perf_counter() - t0


def row(
    name: str, n: int, when: list[float], wall: float, out: list[object], made: int
) -> list[str]:
    fails = sum(isinstance(r, corral.CorralError) for r in out)
    return [
        name,
        str(n),
        f"{wall:.1f}",
        f"{n / wall:.0f}",
        f"{median(when) * 1000:.0f}",
        f"{pct(when, 99) * 1000:.0f}",
        str(fails),
        str(made - (n - fails)),
    ]


async def main(n: int) -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    before = leak_counts(DATA)
    cfg = NodeConfig.from_env(data_dir=DATA, images=IMAGES, node="burst")
    rows: list[list[str]] = []
    retry_rows: list[list[str]] = []
    async with corral.AsyncClient(config=cfg) as c:
        key = secrets.token_hex(6)
        when, wall, out = await burst(c, n, key)
        made = len(await c.sandboxes.list(labels={"b": "1"}))
        rows.append(row("embedded (in-process agent)", n, when, wall, out, made))
        print(rows[-1], flush=True)
        t0 = time.perf_counter()
        again = await c.sandboxes.create_many(SPEC, n, concurrency=32, key=key)
        retry = time.perf_counter() - t0
        now = len(await c.sandboxes.list(labels={"b": "1"}))
        same = [getattr(a, "id", None) for a in again] == [getattr(o, "id", None) for o in out]
        retry_rows.append(["embedded", f"{retry:.1f}", str(now - made), str(same)])
        closed = await close_all(c)
        print(f"closed {n} in {closed:.1f}s", flush=True)

    srv = Serve()
    srv.start()
    try:
        async with corral.AsyncClient(f"unix:{srv.sock}") as c:
            key = secrets.token_hex(6)
            when, wall, out = await burst(c, n, key)
            made = len(await c.sandboxes.list(labels={"b": "1"}))
            rows.append(row("through `corral serve` (HTTP, unix socket)", n, when, wall, out, made))
            print(rows[-1], flush=True)
            await close_all(c)
            # Kill the server a quarter of the way in, restart it, retry.
            key = secrets.token_hex(6)
            when, wall, out = await burst(c, n, key, kill_after=n // 4, kill=srv)
        lost = sum(isinstance(r, corral.CorralError) for r in out)
        kinds = sorted({type(r).__name__ for r in out if isinstance(r, corral.CorralError)})
        srv = Serve()
        srv.start()
        async with corral.AsyncClient(f"unix:{srv.sock}") as c:
            t0 = time.perf_counter()
            again = await c.sandboxes.create_many(SPEC, n, concurrency=32, key=key)
            retry = time.perf_counter() - t0
            now = len(await c.sandboxes.list(labels={"b": "1"}))
            ok = sum(isinstance(r, corral.AsyncSandbox) for r in again)
            retry_rows.append(
                [
                    f"server killed after {n // 4} ready; {lost} items failed "
                    f"({', '.join(kinds)}); restarted; retried",
                    f"{retry:.1f}",
                    str(now - ok),
                    f"{ok}/{n} ready after the retry",
                ]
            )
            await close_all(c)
    finally:
        srv.kill(signal.SIGTERM)
    async with corral.AsyncClient(config=cfg):
        pass
    after = leak_counts(DATA)
    sections = [
        f"## A burst of {n} sandboxes on one node\n\n"
        "`client.sandboxes.create_many(spec, n, concurrency=32)`; latency is from the start "
        "of the burst to each sandbox's readiness. Duplicates: sandboxes on the node beyond "
        "one per successful item.\n\n"
        + table(
            [
                "path",
                "sandboxes",
                "all ready (s)",
                "per s",
                "ready p50 (ms)",
                "ready p99 (ms)",
                "failures",
                "duplicates",
            ],
            rows,
        )
        + f"\n\nHTTP overhead: {float(rows[1][3]) / float(rows[0][3]):.2f}x the embedded rate.",
        "## Retrying a burst with the same key\n\n"
        + table(["case", "retry wall (s)", "new sandboxes made twice", "result"], retry_rows),
        "## Leftovers (host-wide, before vs after)\n\n"
        + table(["object", "before", "after"], [[k, str(before[k]), str(after[k])] for k in after]),
    ]
    path = write_result("burst", "Bursts: create_many, retries and a killed server", sections)
    print(f"wrote {path}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=2000)
    asyncio.run(main(ap.parse_args().count))
