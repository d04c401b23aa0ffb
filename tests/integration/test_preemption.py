"""The preemption test: a trainer process driving 32 rollouts of 20 steps
is killed with SIGKILL at a random step, the job's sandboxes are suspended
(suspend_many, the preemption hook), and the restarted trainer resumes:
every rollout ends as an uninterrupted one would, no step run twice."""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import subprocess
import sys
import time
from pathlib import Path

import corral
from corral.rollout import preempt

from ..framework import Node

ROLLOUTS, STEPS = 32, 20
STEPS_PER_ROLLOUT = 2 * STEPS + 2  # create, (policy, command) per step, read back


def _trainer(url: str, job: str, out: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "corral.rollout.preempt", url, job, str(ROLLOUTS), str(STEPS)]
    return subprocess.Popen([*argv, str(out)], stderr=subprocess.DEVNULL)


async def _logged(c: corral.AsyncClient, job: str) -> list[int]:
    service = c._service  # type: ignore[attr-defined]
    names = [preempt.rollout_name(job, i) for i in range(ROLLOUTS)]
    return [len(s) for s in await asyncio.gather(*(service.rollout_steps(n) for n in names))]


async def test_a_killed_trainer_resumes_every_rollout_exactly_once(
    node: Node, server: object, tmp_path: Path
) -> None:
    job, out = f"pre-{secrets.token_hex(4)}", tmp_path / "results.json"
    url = node.server.url
    # Killed once every rollout has its sandbox, somewhere before the end.
    kill_at = random.randint(ROLLOUTS * 4, ROLLOUTS * (STEPS_PER_ROLLOUT - 4))
    trainer = _trainer(url, job, out)
    async with node.http_client() as c:
        deadline = time.monotonic() + 300
        while True:
            counts = await _logged(c, job)
            if sum(counts) >= kill_at and min(counts) >= 1:
                break
            assert trainer.poll() is None, "the trainer ended before it was killed"
            assert time.monotonic() < deadline, f"no progress: {counts}"
            await asyncio.sleep(0.05)
        trainer.kill()
        trainer.wait()
        logged_at_kill = sum(await _logged(c, job))
        # The preemption hook: the job's sandboxes stop holding CPU and memory.
        outcomes = await c.sandboxes.suspend_many({"job": job}, key=f"{job}-preempt")
        assert len(outcomes) == ROLLOUTS
        assert all(o.ok and o.info and o.info.state == "suspended" for o in outcomes), [
            o.error for o in outcomes if not o.ok
        ]
        # The GPUs come back: the same trainer, run again, continues.
        restarted = _trainer(url, job, out)
        assert restarted.wait(300) == 0
        results = json.loads(out.read_text())
        assert preempt.check(results, STEPS) == []
        assert sum(await _logged(c, job)) == ROLLOUTS * STEPS_PER_ROLLOUT
        assert logged_at_kill >= kill_at
        # The sandboxes' own state agrees (their files, read directly).
        for r in results:
            sbx = await c.sandboxes.get(r["sandbox"])
            assert (await sbx.files.read_text("/tmp/steps")).strip() == str(STEPS)
            assert len((await sbx.files.read_text("/tmp/trajectory")).splitlines()) == STEPS
        await asyncio.gather(
            *(s.close() for s in await c.sandboxes.list(labels={"job": job})),
            *(c.rollouts.delete(preempt.rollout_name(job, i)) for i in range(ROLLOUTS)),
        )
