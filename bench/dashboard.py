"""The dashboard's sandbox list with 10,000 sandboxes on the node.

    corral bench dashboard [--n 10000] [--loads 20]

A real `corral serve` (with an API key) whose node store (node/store.py)
was filled, before it started, with N closed sandbox records through the
store's own insert(): closed, so that no container is needed for them, and
the node keeps them (it purges closed records only after their retention).
Each load is a real HTTP GET over TCP with the key, through the
dashboard's real list path (the store's list of every state, the filters,
the counts, one page of 200 rows rendered). Target: p99 under 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx

from _common import IMAGE, IMAGES, fresh_dir, pct, serve, table, wait_up, write_result
from corral.config import NodeConfig
from corral.node.store import SandboxRecord, Store

DATA = Path("/var/lib/corral-dashboard-bench")
KEY = "bench-dashboard-key"
PAGES = {
    "/ui (all, page 1)": "/ui",
    "/ui?state=closed&page=25": "/ui?state=closed&page=25",
    "/ui?label=job=j7": "/ui?label=job%3Dj7",
    "/ui?q=<id part>": "/ui?q=00000000000012",
}


def fill(cfg: NodeConfig, n: int) -> float:
    """n closed records through Store.insert, in one transaction; seconds."""
    store = Store(cfg.db_path)
    now = time.time()
    spec = {"image": IMAGE, "cpu": 1.0, "memory": 1 << 30, "disk": 2 << 30, "pids": 512}
    t0 = time.perf_counter()
    with store.transaction():
        for i in range(n):
            store.insert(
                SandboxRecord(
                    id=f"{cfg.node}-{i:016x}",
                    kind="container",
                    state="closed",
                    spec=spec,
                    layers=[],
                    image_env=[],
                    workdir="/",
                    created_at=now - n + i,
                    expires_at=None,
                    last_active=now,
                    owner="bench",
                    closed_at=now,
                    labels={"job": f"j{i % 100}", "bench": "dashboard"},
                )
            )
    took = time.perf_counter() - t0
    store.close()
    return took


async def loads(url: str, path: str, n: int) -> tuple[list[float], int]:
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {KEY}"}, timeout=60) as h:
        for _ in range(2):  # warm: the first page starts the metrics sampler
            (await h.get(url + path)).raise_for_status()
        out, size = [], 0
        for _ in range(n):
            t0 = time.perf_counter()
            r = await h.get(url + path)
            out.append(time.perf_counter() - t0)
            r.raise_for_status()
            size = len(r.content)
        return out, size


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--loads", type=int, default=20)
    a = ap.parse_args()
    fresh_dir(DATA)
    cfg = NodeConfig.from_env(data_dir=DATA, images=IMAGES)
    filled = fill(cfg, a.n)
    os.environ["CORRAL_API_KEY"] = KEY
    proc, url = serve(DATA)
    rows = []
    try:
        await wait_up(url)
        for name, path in PAGES.items():
            xs, size = await loads(url, path, a.loads)
            rows.append(
                [
                    name,
                    f"{pct(xs, 50) * 1000:.0f}",
                    f"{pct(xs, 99) * 1000:.0f}",
                    f"{size / 1024:.0f}",
                    "yes" if pct(xs, 99) < 1.0 else "NO",
                ]
            )
            print(rows[-1], flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    how = (
        f"{a.n} sandboxes: closed records inserted into the node's own store "
        f"(Store.insert, one transaction, {filled:.2f} s) before `corral serve` started; "
        f"two labels each. {a.loads} loads per page after 2 warm-up loads, one at a time, "
        "over TCP with the API key (httpx), each rendering at most 200 rows."
    )
    write_result(
        "dashboard",
        "The dashboard's sandbox list at 10,000 sandboxes",
        [
            how,
            table(["page", "p50 ms", "p99 ms", "page KiB", "p99 < 1 s"], rows),
        ],
    )


if __name__ == "__main__":
    asyncio.run(main())
