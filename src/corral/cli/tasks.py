"""`corral tasks run`: harbor-format tasks on Corral, without harbor."""

from __future__ import annotations

import argparse
import statistics
import time

from rich.console import Console
from rich.table import Table

from corral.cli.args import open_client
from corral.cli.output import emit
from corral.errors import InvalidArgument


async def tasks_run(a: argparse.Namespace) -> int:
    from corral.tasks.runner import Runner, TrialResult, command_agent, nop, oracle
    from corral.tasks.task import discover

    if a.concurrency < 1 or a.attempts < 1:
        raise InvalidArgument("concurrency", "and attempts must be at least 1",
                              (a.concurrency, a.attempts))  # fmt: skip
    found = discover(a.path)
    agent = command_agent(a.agent_cmd) if a.agent_cmd else {"oracle": oracle, "nop": nop}[a.agent]
    console = Console(stderr=True)

    def done(r: TrialResult) -> None:
        if not a.json:
            mark = "[green]1.0[/green]" if r.reward == 1.0 else f"[red]{r.reward:g}[/red]"
            console.print(f"{r.task}: {mark} in {r.wall_s:.1f} s {r.error[:200]}")

    t0 = time.monotonic()
    async with open_client(a) as client:
        results = await Runner(client, labels={"job": "tasks"}).run_all(
            found, agent, attempts=a.attempts, concurrency=a.concurrency, on_done=done
        )
    wall = time.monotonic() - t0
    doc = {
        "trials": len(results),
        "mean_reward": statistics.mean(r.reward for r in results),
        "errors": sum(bool(r.error) for r in results),
        "wall_s": wall,
        "results": [vars(r) | {"reward": r.reward} for r in results],
    }
    table = Table(title=f"{len(results)} trials, {wall:.1f} s to the last result")
    for col in ("task", "trials", "mean reward", "errors", "agent p50", "verify p50"):
        table.add_column(col)
    for t in found:
        mine = [r for r in results if r.task == t.name]
        table.add_row(t.name, str(len(mine)), f"{statistics.mean(r.reward for r in mine):.2f}",
                      str(sum(bool(r.error) for r in mine)),
                      f"{statistics.median(r.agent_s for r in mine):.2f} s",
                      f"{statistics.median(r.verify_s for r in mine):.2f} s")  # fmt: skip
    if a.json:
        emit(a, doc, "")
    else:
        Console().print(table)
    return 0 if not doc["errors"] else 1
