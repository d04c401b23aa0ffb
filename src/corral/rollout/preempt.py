"""A trainer that survives being killed: the preemption test's and the
demo's agent loop.

    python -m corral.rollout.preempt URL JOB ROLLOUTS STEPS OUT

drives ROLLOUTS rollouts of STEPS steps each against the Corral at URL, all
at once. A step is a policy's action (a random number, recorded in the
rollout's log: a real trainer's LLM call) and a command with side effects
counted inside the sandbox: it appends the step and the action to a file
and bumps a counter, and its output is what the policy sees next. At the
end each rollout reads its file back, and OUT gets every rollout's results
as JSON.

Kill it at any moment (SIGKILL) and run it again with the same arguments:
it fast-forwards through what its rollouts logged and continues live; no
step runs twice (sdk/rollouts.py says why).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

import corral

IMAGE = "debian-python:bookworm"
STEP = (
    "echo {k}:{action} >> /tmp/trajectory; "
    "n=$(cat /tmp/steps 2>/dev/null || echo 0); echo $((n+1)) > /tmp/steps; cat /tmp/steps"
)


def rollout_name(job: str, i: int) -> str:
    return f"{job}-{i}"


async def one(client: corral.AsyncClient, job: str, i: int, steps: int) -> dict[str, Any]:
    r = await client.rollouts.open(rollout_name(job, i))
    sbx = await r.create(image=IMAGE, memory="64MiB", labels={"job": job}, idle_timeout=None)
    seen = "0"
    results: list[str] = []
    for k in range(steps):
        action = await r.record("policy", lambda: random.randint(0, 10**6), args=[k, seen])
        res = await sbx.commands.run(STEP.format(k=k, action=action))
        seen = res.stdout.strip()
        results.append(f"{k}:{action}:{seen}")
    trajectory = await sbx.files.read_text("/tmp/trajectory")
    return {"sandbox": sbx.id, "results": results, "trajectory": trajectory.splitlines()}


async def train(url: str, job: str, rollouts: int, steps: int) -> list[dict[str, Any]]:
    async with corral.AsyncClient(url) as client:
        return list(await asyncio.gather(*(one(client, job, i, steps) for i in range(rollouts))))


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    url, job, rollouts, steps, out = argv
    results = asyncio.run(train(url, job, int(rollouts), int(steps)))
    tmp = Path(f"{out}.tmp")
    tmp.write_text(json.dumps(results))
    os.replace(tmp, out)
    return 0


def check(results: list[dict[str, Any]], steps: int) -> list[str]:
    """What is wrong with a job's results (nothing: []). Every rollout must
    have run each step exactly once, in order: its file holds one line per
    step, with the action the trainer reports, and the counter the command
    saw is the step's number."""
    problems = []
    for i, r in enumerate(results):
        want = [line.rsplit(":", 1)[0] for line in r["results"]]
        if r["trajectory"] != want:
            problems.append(f"rollout {i}: trajectory {r['trajectory']} != steps {want}")
        counts = [int(line.rsplit(":", 1)[1]) for line in r["results"]]
        if counts != list(range(1, steps + 1)):
            problems.append(f"rollout {i}: step counters {counts}")
    return problems


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
