"""The preemption test: a trainer process driving 32 rollouts of 20 steps
is killed with SIGKILL at a random step, the job's sandboxes are suspended
(suspend_many, the preemption hook), and the restarted trainer resumes:
every rollout ends as an uninterrupted one would, no step run twice
(corral/rollout/preempt.py is the trainer and the driver). Then the same
with the job moved to another node of a cluster."""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import pytest

from corral.rollout import preempt
from corral.runtimes.container import criu

from ..framework import Cluster, Node

ROLLOUTS, STEPS = 32, 20


@pytest.mark.parametrize("mode", ["freeze", "disk"])
async def test_a_killed_trainer_resumes_every_rollout_exactly_once(
    node: Node, server: object, tmp_path: Path, mode: str
) -> None:
    if mode == "disk" and criu.available():
        pytest.fail(f"containers suspend to disk with CRIU: {criu.available()}")
    job, url = f"pre-{secrets.token_hex(4)}", node.server.url
    report = await preempt.survive(
        url, job, ROLLOUTS, STEPS, tmp_path / "results.json", hook=preempt.suspend_hook(mode)
    )
    assert (report.preempted, report.refused) == (ROLLOUTS, [])
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


@pytest.mark.slow
@pytest.mark.requires_postgres
async def test_a_killed_trainers_job_moves_to_another_node_and_resumes(
    data_root: Path, tmp_path: Path
) -> None:
    """The same job through a cluster's gateway, preempted with its host:
    each sandbox is saved to disk and closed, the host goes away (its agent
    stops, the gateway writes it off), another node joins, and the saved
    sandboxes are restored there. The restarted trainer replays its logs
    onto the copies: every rollout ends as an uninterrupted one would."""
    if criu.available():
        pytest.fail(f"containers move with CRIU: {criu.available()}")
    # Not 2 s: 32 first creates on a fresh node (its lazy loader starting,
    # every chunk cold) delayed a 1 s heartbeat to 2.06 s on 2 cores, the
    # gateway wrote the node off and its sandboxes were closed under the
    # trainer (the node's log says heartbeat.late when a beat comes late).
    cluster = Cluster(data_root / "preempt", nodes=2, node_timeout=5.0)
    first, second = cluster.nodes
    try:
        cluster.start(only=[first.name])
        key = cluster.project("preempted", max_sandboxes=2 * ROLLOUTS)
        assert cluster.gateway is not None
        url, job = cluster.gateway.url, f"mv-{secrets.token_hex(4)}"

        async def hosts_change() -> None:
            await asyncio.to_thread(first.server.stop)
            await asyncio.to_thread(cluster.wait_alive, [first.name], 30, "lost")
            await asyncio.to_thread(cluster.join, second)

        report = await preempt.survive(
            url, job, ROLLOUTS, STEPS, tmp_path / "results.json",
            hook=preempt.move_hook(hosts_change), api_key=key,
        )  # fmt: skip
        assert (report.preempted, report.refused) == (ROLLOUTS, [])
        assert report.problems == []
        async with cluster.client(key) as c:
            for r in report.results:
                assert r["sandbox"].split("-")[0] == second.name
                sbx = await c.sandboxes.get(r["sandbox"])
                assert sbx.info.labels["corral.restored_from"].split("-")[0] == first.name
                assert (await sbx.files.read_text("/tmp/steps")).strip() == str(STEPS)
            logs = [await c.rollouts.open(preempt.rollout_name(job, i)) for i in range(ROLLOUTS)]
            assert {r.logged for r in logs} == {preempt.logged_steps(STEPS)}
        await preempt.clean(url, job, ROLLOUTS, api_key=key)
        assert cluster.used("preempted") == (0, 0.0, 0)
    finally:
        cluster.stop()
    assert {n.name: n.leftovers() for n in cluster.nodes} == {n.name: {} for n in cluster.nodes}
