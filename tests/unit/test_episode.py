"""The episode core of the framework adapters (corral.integrations.episode)
over a fake service whose "sandbox" is a dict of files and whose commands
are a tiny script language: the rules of steps, grading, limits and
failures, without a kernel. The real thing is tests/integration/
test_rl_adapters.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

import corral
from corral.api.models import (
    ExecEvent,
    ExecExit,
    ExecOutput,
    ExecRequest,
    ExecStarted,
)
from corral.errors import SandboxNotFound
from corral.integrations.actions import Edit, Read, Shell, Submit, Write, from_text
from corral.integrations.episode import AsyncEpisode, EpisodeSpec

from .test_http_api import FakeService


class Box(FakeService):
    """`cat F` prints a file; `grade` exits 0 when calc.py adds; `big`
    prints a flood; `slow` times out; `fail` exits 2; `gone` finds the
    sandbox closed."""

    def __init__(self) -> None:
        super().__init__()
        self.closed: list[str] = []

    async def close(self, sandbox_id: str) -> None:
        await self.get(sandbox_id)
        self.closed.append(sandbox_id)
        del self.boxes[sandbox_id]

    async def exec(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        await self.get(sandbox_id)
        cmd = req.cmd if isinstance(req.cmd, str) else " ".join(req.cmd)
        yield ExecStarted(pid=7)
        code, out = 0, b""
        if cmd.startswith("cat "):
            out = self.files.get("/w/" + cmd[4:], b"")
        elif cmd == "grade":
            code = 0 if b"a + b" in self.files.get("/w/calc.py", b"") else 1
        elif cmd == "big":
            out = b"x" * 100_000
        elif cmd == "fail":
            code = 2
        elif cmd == "gone":
            raise SandboxNotFound("sandbox closed under the agent", sandbox=sandbox_id)
        if cmd == "slow":
            yield ExecExit(exit_code=-9, signal=9, timed_out=True)
            return
        if out:
            yield ExecOutput(type="stdout", data=out)
        yield ExecExit(exit_code=code, stdout_bytes=len(out), duration=0.001)


def spec(**over: Any) -> EpisodeSpec:
    return EpisodeSpec.from_config({"image": "img:1", "workdir": "/w", "test": "grade", **over})


async def episode(box: Box, **over: Any) -> AsyncEpisode:
    ep = AsyncEpisode(corral.AsyncClient(transport=box), spec(**over), labels={"t": "1"})
    await ep.start()
    box.files["/w/calc.py"] = b"def add(a, b):\n    return a - b\n"
    return ep


async def test_state_carries_and_the_test_grades_the_fix() -> None:
    box = Box()
    ep = await episode(box)
    assert (await ep.act(Read("calc.py"))).observation.endswith("return a - b\n")
    assert (await ep.act(Edit("calc.py", "a - b", "a + b"))).ok
    step = await ep.act(Shell("cat calc.py"))
    assert "a + b" in step.observation and step.observation.startswith("exit code 0")
    graded = await ep.act(Submit())
    assert (graded.done, graded.reward, graded.truncated) == (True, 1.0, False)
    assert await ep.reward() == 1.0  # once: the same value again
    assert ep.stats.steps == 3
    await ep.close()
    await ep.close()  # idempotent
    assert len(box.closed) == 1


async def test_the_step_limit_grades_and_truncates() -> None:
    box = Box()
    ep = await episode(box, max_steps=2)
    assert not (await ep.act(Write("x.txt", "1"))).done
    last = await ep.act(Shell("fail"))
    assert (last.done, last.truncated, last.reward, last.ok) == (True, True, 0.0, False)
    after = await ep.act(Shell("cat x.txt"))
    assert after.done and "over" in after.observation and not after.ok


@pytest.mark.parametrize(
    ("action", "says"),
    [
        (Edit("calc.py", "nowhere", "x"), "was not found"),
        (Edit("calc.py", "a", "x"), "appears 3 times"),
        (Read("missing.py"), "No such file"),
        (Shell("slow"), "timed out"),
        (from_text("no tags here"), "no action found"),
    ],
)
async def test_the_agents_mistakes_are_observations(action: Any, says: str) -> None:
    ep = await episode(Box())
    step = await ep.act(action)
    assert not step.ok and not step.done and says in step.observation, step.observation
    await ep.close()


async def test_a_flood_is_clipped_to_the_observation_limit() -> None:
    ep = await episode(Box(), observation_limit=1000)
    step = await ep.act(Shell("big"))
    assert len(step.observation) <= 1000 and "characters cut" in step.observation
    await ep.close()


async def test_a_sandbox_gone_ends_the_episode() -> None:
    ep = await episode(Box())
    step = await ep.act(Shell("gone"))
    assert (step.done, step.reward, step.ok) == (True, 0.0, False)
    assert "gone" in step.observation and ep.closed


async def test_a_failed_setup_leaves_no_sandbox() -> None:
    box = Box()
    ep = AsyncEpisode(corral.AsyncClient(transport=box), spec(setup=["fail"]))
    with pytest.raises(corral.InvalidArgument, match="setup"):
        await ep.start()
    assert box.boxes == {} and len(box.closed) == 1
