"""What a project's API key costs a request through the gateway, and what
managing keys costs, on a real PostgreSQL.

    corral bench keys [--n 2000]

The same authenticated read (`GET /v1/sandboxes` on a cluster of no nodes:
the key check and little else) three ways: a gateway serving a key it
checked less than keys.RECHECK ago (the usual case), a gateway that checks
the key in the store on every request (RECHECK = 0: the cost of a check),
and the peer, a node's server with its one static key (no store at all).
Then making a key for a sub-project (`client.keys.create`), listing, and
revoking a key with a line of 10 keys made from it. In process, over
ASGI: the HTTP stack is not what is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import httpx  # noqa: E402

import corral  # noqa: E402
from _common import fresh_dir, median, pct, table, timed, write_result  # noqa: E402
from corral.api.app import create_app  # noqa: E402
from corral.api.http import HttpService  # noqa: E402
from corral.control import keys, quotas  # noqa: E402
from corral.control.gateway import Gateway  # noqa: E402
from corral.control.postgres import LocalPostgres  # noqa: E402
from corral.control.schema import migrate  # noqa: E402
from corral.db import connect  # noqa: E402

WORK = Path("/var/lib/corral-bench-keys")


class _NoSandboxes:
    async def list(self, labels: object = None) -> list[object]:
        return []


def _client(app: object, key: str) -> corral.AsyncClient:
    http = HttpService(
        "http://bench",
        api_key=key,
        transport=httpx.ASGITransport(app=app),  # type: ignore[arg-type]
    )
    return corral.AsyncClient(transport=http)


def _ms(values: list[float]) -> list[str]:
    return [f"{median(values) * 1000:.2f}", f"{pct(values, 99) * 1000:.2f}"]


async def main(n: int) -> None:
    work = fresh_dir(WORK)
    work.chmod(0o755)  # the postgres user enters it
    try:
        pg = LocalPostgres(work / "pg", port=5491)
        url = pg.start()
        try:
            db = await connect(url)
            await migrate(db)
            await quotas.create_project(db, "team")
            await quotas.create_project(db, "job", parent="team")
            team, _ = await keys.create_key(db, "team")
            gw = await Gateway(db, node_key=None).start(sweep=False)
            app = create_app(None, for_token=gw.for_token, for_sandbox=gw.for_sandbox)
            peer = create_app(_NoSandboxes(), api_key=team)  # type: ignore[arg-type]
            rows = []
            async with _client(peer, team) as c:
                await c.sandboxes.list()
                floor = await timed(n, c.sandboxes.list)
            async with _client(app, team) as c:
                await c.sandboxes.list()
                cached = await timed(n, c.sandboxes.list)
                keys.RECHECK = 0.0
                checked = await timed(n, c.sandboxes.list)
                keys.RECHECK = 5.0
                rows.append(["node server, one static key (peer)", *_ms(floor), "1.00x"])
                for name, got in (("gateway, key checked < 5 s ago", cached),
                                  ("gateway, key checked in the store", checked)):  # fmt: skip
                    rows.append([name, *_ms(got), f"{median(got) / median(floor):.2f}x"])
                made: list[corral.ApiKey] = []

                async def mint() -> None:
                    made.append(await c.keys.create(project="job", expires="1h"))

                minting = await timed(min(n, 500), mint)
                listing = await timed(50, c.keys.list)
                lines = []
                for _ in range(20):  # a key and a line of 10 keys made from it
                    root = await c.keys.create(project="job")
                    assert root.api_key is not None
                    parent = root.api_key
                    for _ in range(10):
                        async with _client(app, parent) as p:
                            child = await p.keys.create()
                        assert child.api_key is not None
                        parent = child.api_key
                    lines.append(root.id)
                revoking: list[float] = []
                for key_id in lines:
                    t0 = time.perf_counter()
                    gone = await c.keys.revoke(key_id)
                    revoking.append(time.perf_counter() - t0)
                    assert len(gone.also_revoked) == 10
            live = len(await keys.list_keys(db))
            await gw.aclose()
            await db.aclose()
        finally:
            pg.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ops = [
        ["make a key for a sub-project", *_ms(minting), str(len(minting))],
        [f"list the subtree's keys ({live} there)", *_ms(listing), "50"],
        ["revoke a key and the 10 made from it", *_ms(revoking), str(len(revoking))],
    ]
    path = write_result(
        "keys",
        "API keys: what a check costs a request, and what managing keys costs",
        [
            f"An authenticated read through each, {n} in a row, one client (ms):\n\n"
            + table(["", "p50", "p99", "vs peer"], rows),
            "Key management through the gateway, PostgreSQL store (ms):\n\n"
            + table(["", "p50", "p99", "n"], ops),
            "The gateway checks a key in the store once per keys.RECHECK (5 s) and "
            "then serves it from memory, by hash; an expiry is still honoured to the "
            "second. The peer has no store: one key, compared in constant time.",
        ],
    )
    print(path.read_text())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n", type=int, default=2000)
    asyncio.run(main(parser.parse_args().n))
