"""The main job: a batch of agent rollouts on sandboxes, embedded.

Each rollout is what an RL coding agent's environment does: start a sandbox
on a base image with a project's workspace and a test toolkit composed over
it, run the project's test suite as the reward signal, and throw the sandbox
away. The batch runs all sandboxes at once, as a training step would.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from corral.config import NodeConfig
from corral.images.store import ImageStore
from corral.progress import progress_bar
from corral.rollout import demo_images as di
from corral.rollout import humaneval, preempt, rl_demo
from corral.sdk.client import AsyncClient
from corral.sdk.sandbox import AsyncSandbox


@dataclass
class Rollout:
    project: str
    create_s: float = 0.0
    exec_s: float = 0.0
    exit_code: int = -1
    summary: str = ""


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


async def run_demo(config: NodeConfig, *, sandboxes: int = 48, as_json: bool = False) -> int:
    console = Console(width=120)
    store = ImageStore(config.images_dir)
    with progress_bar(disable=as_json) as progress:
        await asyncio.to_thread(
            di.ensure_all, store, config.data_dir / "cache" / "sdists", progress
        )

    projects = [di.PROJECTS[i % len(di.PROJECTS)] for i in range(sandboxes)]
    rollouts = [Rollout(p.name) for p in projects]
    boxes: list[AsyncSandbox | None] = [None] * sandboxes
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        disable=as_json,
        console=console,
    )
    async with AsyncClient(config=config) as client:
        mem_before = _mem_available()
        wall0 = time.monotonic()
        with bar:
            creating = bar.add_task("create sandboxes", total=sandboxes)
            testing = bar.add_task("run test suites", total=sandboxes)

            async def create(i: int) -> None:
                t0 = time.monotonic()
                boxes[i] = await client.sandboxes.create(
                    image=di.BASE,
                    workspace=projects[i].ref,
                    toolkit=di.TOOLKIT,
                    cpu=1.0,
                    memory="512MiB",
                    disk="1GiB",
                    ttl=900,
                    labels={"job": "demo", "project": projects[i].name},
                )
                rollouts[i].create_s = time.monotonic() - t0
                bar.advance(creating)

            await asyncio.gather(*(create(i) for i in range(sandboxes)))
            await asyncio.sleep(1.0)  # let the page cache and slabs settle
            mem_idle = _mem_available()

            async def test(i: int) -> None:
                sbx = boxes[i]
                assert sbx is not None
                t0 = time.monotonic()
                r = await sbx.commands.run(projects[i].test_command, timeout=600)
                rollouts[i].exec_s = time.monotonic() - t0
                rollouts[i].exit_code = r.exit_code
                lines = [ln for ln in r.stdout.strip().splitlines() if ln.strip()]
                rollouts[i].summary = re.sub(r"=+", "", lines[-1]).strip() if lines else ""
                bar.advance(testing)

            await asyncio.gather(*(test(i) for i in range(sandboxes)))
        t_close = time.monotonic()
        await asyncio.gather(*(b.close() for b in boxes if b is not None))
        close_s = (time.monotonic() - t_close) / sandboxes
        wall = time.monotonic() - wall0

        # The other half of an RL step on code: rewards for many small
        # programs, judged as stateless function calls from a warm pool.
        for task in list(bar.task_ids):
            bar.remove_task(task)  # printed already; show only the new one
        with bar:
            judging = bar.add_task("judge HumanEval (function calls)", total=328)
            judged = await humaneval.judge(client, on_done=lambda: bar.advance(judging))

    # Preemption: the trainer is killed mid-batch; its sandboxes are
    # suspended, and the trainer run again continues every rollout.
    if not as_json:
        console.print("[bold]preemption:[/bold] 16 rollouts of 20 steps; the trainer is killed")
    survived = await preempt.survive_on_a_server(config, rollouts=16, steps=20)
    if not as_json:
        console.print("[bold]RL episodes:[/bold] 32 at once through the gymnasium adapter")
    rl = (await asyncio.to_thread(rl_demo.run, config, episodes=32)).doc()

    per_sandbox_mem = max(0, mem_before - mem_idle) / sandboxes
    creates = [r.create_s for r in rollouts]
    execs = [r.exec_s for r in rollouts]
    failed = [r for r in rollouts if r.exit_code != 0]
    by_project: dict[str, list[Rollout]] = {}
    for r in rollouts:
        by_project.setdefault(r.project, []).append(r)

    projects_doc: dict[str, dict[str, Any]] = {
        name: {
            "sandboxes": len(rs),
            "passed": sum(r.exit_code == 0 for r in rs),
            "failed": sum(r.exit_code != 0 for r in rs),
            "exec_median_s": statistics.median(r.exec_s for r in rs),
            "pytest": rs[0].summary,
        }
        for name, rs in by_project.items()
    }
    doc: dict[str, Any] = {
        "sandboxes": sandboxes,
        "create_p50_ms": pct(creates, 50) * 1000,
        "create_p99_ms": pct(creates, 99) * 1000,
        "exec_p50_s": pct(execs, 50),
        "exec_p99_s": pct(execs, 99),
        "close_ms_per_sandbox": close_s * 1000,
        "wall_s": wall,
        "host_memory_per_idle_sandbox_mib": per_sandbox_mem / 2**20,
        "projects": projects_doc,
        "humaneval": {
            "calls": judged.calls,
            "canonical_passed": judged.canonical_passed,
            "broken_failed": judged.broken_failed,
            "calls_per_s": judged.calls_per_s,
            "latency_p50_ms": judged.median_ms,
            "latency_p99_ms": judged.latency_ms(99),
        },
    }
    doc["preemption"] = {
        "rollouts": survived.rollouts,
        "steps": survived.steps,
        "killed_after_logged_steps": survived.killed_at,
        "suspended": survived.preempted,
        "suspend_many_ms": survived.preempt_s * 1000,
        "restart_s": survived.restart_s,
        "problems": survived.problems,
    }
    doc["rl"] = rl
    ok = not failed and judged.all_correct and not survived.problems and not rl["problems"]
    if as_json:
        print(json.dumps(doc))
        return 0 if ok else 1

    summary = Table(title=f"Rollout batch: {sandboxes} sandboxes at once (embedded node)")
    for col in (
        "sandboxes",
        "create p50",
        "create p99",
        "exec p50",
        "exec p99",
        "close / sandbox",
        "host memory / idle sandbox",
        "wall",
    ):
        summary.add_column(col, justify="right")
    summary.add_row(
        str(sandboxes),
        f"{doc['create_p50_ms']:.0f} ms",
        f"{doc['create_p99_ms']:.0f} ms",
        f"{doc['exec_p50_s']:.2f} s",
        f"{doc['exec_p99_s']:.2f} s",
        f"{close_s * 1000:.0f} ms",
        f"{doc['host_memory_per_idle_sandbox_mib']:.2f} MiB",
        f"{wall:.1f} s",
    )
    console.print(summary)
    table = Table(title="Test suites (reward signal) per project")
    for col in (
        "project",
        "workspace layer",
        "sandboxes",
        "pass",
        "fail",
        "exec median",
        "pytest says",
    ):
        table.add_column(col)
    for p in di.PROJECTS:
        info = projects_doc.get(p.name)
        if not info:
            continue
        table.add_row(
            p.name,
            p.ref,
            str(info["sandboxes"]),
            str(info["passed"]),
            str(info["failed"]),
            f"{info['exec_median_s']:.2f} s",
            info["pytest"],
        )
    console.print(table)
    for r in failed[:3]:
        console.print(f"[red]failed[/red] {r.project}: exit {r.exit_code}: {r.summary}")
    he = Table(title="HumanEval judged through function calls (warm pool, clean worker per call)")
    for col in (
        "calls",
        "canonical solutions passed",
        "broken bodies failed",
        "calls/s",
        "latency p50",
        "latency p99",
        "wall",
    ):
        he.add_column(col, justify="right")
    he.add_row(
        str(judged.calls),
        f"{judged.canonical_passed}/{judged.canonical_total}",
        f"{judged.broken_failed}/{judged.broken_total}",
        f"{judged.calls_per_s:.0f}",
        f"{judged.median_ms:.0f} ms",
        f"{judged.latency_ms(99):.0f} ms",
        f"{judged.wall_s:.1f} s",
    )
    console.print(he)
    for line in judged.wrong[:3]:
        console.print(f"[red]misjudged[/red] {line}")
    pre = Table(title="Preemption: the trainer killed (SIGKILL), its job suspended, run again")
    for col in (
        "rollouts x steps",
        "killed after (logged steps)",
        "suspended (suspend_many)",
        "restarted trainer to the end",
        "steps run twice or lost",
    ):
        pre.add_column(col, justify="right")
    pre.add_row(
        f"{survived.rollouts} x {survived.steps}",
        f"{survived.killed_at} of {survived.rollouts * preempt.logged_steps(survived.steps)}",
        f"{survived.preempted} in {survived.preempt_s * 1000:.0f} ms",
        f"{survived.restart_s:.1f} s",
        "none" if not survived.problems else str(len(survived.problems)),
    )
    console.print(pre)
    for line in survived.problems[:3]:
        console.print(f"[red]preemption[/red] {line}")
    print_rl(console, rl)
    return 0 if ok else 1


def print_rl(console: Console, rl: dict[str, Any]) -> None:
    title = "RL episodes: a broken function fixed in 5 steps, the tests as reward, cheats filtered"
    t = Table(title=f"{title} (gym)")
    for col in (
        "episodes",
        "honest rewarded",
        "wrong rewarded",
        "cheats flagged",
        "steps/s",
        "episodes/s",
        "overhead/step p50",
        "p99",
        "reset p50",
        "wall",
    ):
        t.add_column(col, justify="right")
    t.add_row(
        str(rl["episodes"]),
        f"{rl['honest_rewarded']}/{rl['honest']}",
        f"{rl['wrong_rewarded']}/{rl['wrong']}",
        f"{rl['cheats_flagged']}/{rl['cheats']}, kept {rl['cheats_rewarded']}",
        f"{rl['steps_per_s']:.1f}",
        f"{rl['episodes_per_s']:.2f}",
        f"{rl['overhead_p50_ms']:.1f} ms",
        f"{rl['overhead_p99_ms']:.1f} ms",
        f"{rl['reset_p50_s']:.2f} s",
        f"{rl['wall_s']:.1f} s",
    )
    console.print(t)
    for line in rl["problems"][:3]:
        console.print(f"[red]rl[/red] {line}")


async def run_rl_demo(config: NodeConfig, *, as_json: bool = False) -> int:
    """`corral demo rl`: the RL section alone."""
    console = Console(width=120)
    store = ImageStore(config.images_dir)
    with progress_bar(disable=as_json) as progress:
        await asyncio.to_thread(
            di.ensure_all, store, config.data_dir / "cache" / "sdists", progress
        )
    rl = (await asyncio.to_thread(rl_demo.run, config, episodes=32)).doc()
    if as_json:
        print(json.dumps({"rl": rl}))
    else:
        print_rl(console, rl)
    return 1 if rl["problems"] else 0
