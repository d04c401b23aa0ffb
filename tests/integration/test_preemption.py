"""The preemption test: a trainer process driving 32 rollouts of 20 steps
is killed with SIGKILL at a random step, the job's sandboxes are suspended
(suspend_many, the preemption hook), and the restarted trainer resumes:
every rollout ends as an uninterrupted one would, no step run twice
(corral/rollout/preempt.py is the trainer and the driver)."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from corral.rollout import preempt
from corral.runtimes.container import criu

from ..framework import Node

ROLLOUTS, STEPS = 32, 20


@pytest.mark.parametrize("mode", ["freeze", "disk"])
async def test_a_killed_trainer_resumes_every_rollout_exactly_once(
    node: Node, server: object, tmp_path: Path, mode: str
) -> None:
    if mode == "disk" and criu.available():
        pytest.fail(f"containers suspend to disk with CRIU: {criu.available()}")
    job, url = f"pre-{secrets.token_hex(4)}", node.server.url
    report = await preempt.survive(url, job, ROLLOUTS, STEPS, tmp_path / "results.json", mode=mode)
    assert (report.suspended, report.refused) == (ROLLOUTS, [])
    assert 0 < report.killed_at < ROLLOUTS * preempt.logged_steps(STEPS)
    assert report.problems == []
    async with node.http_client() as c:
        for r in report.results:
            # The sandboxes' own state agrees (their files, read directly).
            sbx = await c.sandboxes.get(r["sandbox"])
            assert (await sbx.files.read_text("/tmp/steps")).strip() == str(STEPS)
            assert len((await sbx.files.read_text("/tmp/trajectory")).splitlines()) == STEPS
        logs = [await c.rollouts.open(preempt.rollout_name(job, i)) for i in range(ROLLOUTS)]
        assert {r.logged for r in logs} == {preempt.logged_steps(STEPS)}
    await preempt.clean(url, job, ROLLOUTS)
    async with node.http_client() as c:
        assert await c.sandboxes.list(labels={"job": job}) == []
