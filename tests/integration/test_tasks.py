"""harbor-format tasks on Corral without harbor (corral.tasks): the
tasks in tests/integration/tasks/ (a Dockerfile on a Debian base, an
instruction, a reference solution, tests), run with the oracle agent and
with an agent that does nothing, one at a time and 35 at once; and the
task directories that must be refused."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

import corral
from corral.tasks.runner import Runner, nop, oracle
from corral.tasks.task import discover, load

from ..framework import Node
from ..framework.images import require_image

TASKS = Path(__file__).parent / "tasks"
WANT = {"apt-jq": 1.0, "fix-python": 1.0, "hello-file": 1.0, "json-report": 1.0,
        "wrong-solution": 0.0}  # fmt: skip


async def test_the_oracle_scores_each_task_and_nothing_scores_nothing(node: Node) -> None:
    require_image("debian-python:bookworm")
    tasks = discover(TASKS)
    assert sorted(t.name for t in tasks) == sorted(WANT)
    async with node.client() as c:
        runner = Runner(c, labels={"test": "tasks"})
        solved = await runner.run_all(tasks, oracle, concurrency=5)
        assert {r.task: r.reward for r in solved} == WANT, [(r.task, r.error) for r in solved]
        assert all(not r.error for r in solved)
        json_report = next(r for r in solved if r.task == "json-report")
        assert json_report.rewards == {"reward": 1.0, "lines_ok": 1.0}  # reward.json's names
        idle = await runner.run_all(tasks, nop, concurrency=5)
        assert {r.reward for r in idle} == {0.0}, [(r.task, r.rewards) for r in idle]
        assert await c.sandboxes.list({"test": "tasks"}) == []


async def test_35_trials_at_once(node: Node) -> None:
    require_image("debian-python:bookworm")
    tasks = discover(TASKS)
    async with node.client() as c:
        t0 = time.monotonic()
        results = await Runner(c, labels={"test": "tasks-35"}).run_all(
            tasks, oracle, attempts=7, concurrency=35
        )
        wall = time.monotonic() - t0
        assert len(results) == 35
        bad = [(r.task, r.reward, r.error) for r in results if r.reward != WANT[r.task]]
        assert not bad, bad
        assert await c.sandboxes.list({"test": "tasks-35"}) == []
    print(f"35 trials at once: {wall:.1f} s to the last result")


def _copy(tmp: Path, name: str = "hello-file") -> Path:
    dest = tmp / name
    shutil.copytree(TASKS / name, dest)
    return dest


@pytest.mark.parametrize(
    ("breaking", "field"),
    [
        (lambda d: (d / "tests" / "test.sh").unlink(), "task"),
        (lambda d: (d / "environment" / "Dockerfile").unlink(), "task"),
        (lambda d: (d / "task.toml").write_text("[agent\n"), "task.toml"),
        (lambda d: (d / "task.toml").write_text('[environment]\nnetwork_mode = "lan"\n'),
         "task.toml.environment.network_mode"),
        (lambda d: (d / "task.toml").write_text("[agent]\ntimeout_sec = -1\n"),
         "task.toml.agent.timeout_sec"),
        (lambda d: (d / "task.toml").write_text("[environment]\nallowed_hosts = 3\n"),
         "task.toml.environment.allowed_hosts"),
    ],
)  # fmt: skip
def test_a_bad_task_directory_is_refused_by_field(tmp_path: Path, breaking: object,
                                                  field: str) -> None:  # fmt: skip
    task = _copy(tmp_path)
    breaking(task)  # type: ignore[operator]
    with pytest.raises(corral.InvalidArgument) as err:
        load(task)
    assert err.value.details["field"] == field, err.value


async def test_a_failing_trial_is_its_own_result(node: Node, tmp_path: Path) -> None:
    require_image("debian-python:bookworm")
    silent = _copy(tmp_path, "hello-file")
    (silent / "tests" / "test.sh").write_text("#!/bin/bash\necho no reward written\n")
    broken = _copy(tmp_path / "b", "fix-python")
    (broken / "environment" / "Dockerfile").write_text("FROM debian-python:bookworm\nRUN exit 7\n")
    async with node.client() as c:
        results = await Runner(c, labels={"test": "tasks-bad"}).run_all(
            [load(silent), load(broken)], oracle
        )
        assert await c.sandboxes.list({"test": "tasks-bad"}) == []
    by = {r.task: r for r in results}
    assert by["hello-file"].reward == 0.0 and "no /logs/verifier/reward.txt" in by[
        "hello-file"].error  # fmt: skip
    assert "line 2" in by["fix-python"].error and "exited 7" in by["fix-python"].error
