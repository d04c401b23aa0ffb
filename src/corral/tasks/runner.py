"""Run harbor-format tasks on Corral, without harbor (`corral tasks run`).

A trial is harbor's: the task's environment image built from its
Dockerfile (by Corral's builder: cached, one build per image however many
trials ask at once), a sandbox on it with the task's resources and network
mode, the agent's turn (the oracle runs solution/solve.sh), then the
verifier's: tests/ uploaded only now (the agent never sees them), test.sh
run, the reward read from /logs/verifier. The sandbox is closed whatever
happens, and a trial's failure is its result, not the batch's.
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import tarfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.build.builder import Builder, Options
from corral.errors import CorralError, InvalidArgument
from corral.sdk.client import AsyncClient
from corral.sdk.sandbox import AsyncSandbox
from corral.tasks.task import LOGS, REWARD_JSON, REWARD_TXT, SOLUTION, TESTS, Task

# harbor's "public" has no Corral equivalent of "anywhere": the package
# ecosystems and code hosts a task's setup and solution normally need.
PUBLIC = {"ecosystems": {"pypi": True, "debian": True, "npm": True, "github": True,
                         "huggingface": True}}  # fmt: skip
Agent = Callable[[AsyncSandbox, Task], Awaitable[None]]


@dataclass
class TrialResult:
    task: str
    rewards: dict[str, float] = field(default_factory=dict)
    error: str = ""
    build_s: float = 0.0
    agent_s: float = 0.0
    verify_s: float = 0.0
    wall_s: float = 0.0

    @property
    def reward(self) -> float:
        return self.rewards.get("reward", 0.0) if not self.error else 0.0


def network(task: Task) -> dict[str, Any] | None:
    if task.network_mode == "no-network":
        return None
    if task.network_mode == "allowlist":
        return {"domains": list(task.allowed_hosts)}
    return dict(PUBLIC)


def tar_dir(root: Path) -> bytes:
    """A directory's files as a tar (names relative to it, owned by root)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(root.rglob("*")):
            info = tar.gettarinfo(str(path), str(path.relative_to(root)))
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if info.isreg():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    return buf.getvalue()


async def oracle(sbx: AsyncSandbox, task: Task) -> None:
    """harbor's oracle agent: the task's own solution."""
    if not task.has_solution:
        raise InvalidArgument("agent", "oracle needs the task's solution/solve.sh", task.name)
    await sbx.files.upload_tar(SOLUTION, tar_dir(task.path / "solution"))
    await sbx.commands.run(
        f"chmod +x {SOLUTION}/solve.sh; {SOLUTION}/solve.sh > /logs/agent/oracle.txt 2>&1",
        env={"DEBIAN_FRONTEND": "noninteractive", **task.solution_env},
        timeout=task.agent_timeout, user="root",
    )  # fmt: skip


async def nop(sbx: AsyncSandbox, task: Task) -> None:
    """An agent that does nothing: a task whose tests pass anyway is broken."""


def command_agent(command: str) -> Agent:
    """An agent that is one command in the sandbox (the instruction in
    $TASK_INSTRUCTION)."""

    async def run(sbx: AsyncSandbox, task: Task) -> None:
        await sbx.commands.run(f"({command}) > /logs/agent/agent.txt 2>&1",
                               env={"TASK_INSTRUCTION": task.instruction},
                               timeout=task.agent_timeout)  # fmt: skip

    return run


class Runner:
    def __init__(self, client: AsyncClient, *, labels: dict[str, str] | None = None) -> None:
        self.client = client
        self.labels = labels or {}
        self._builds: dict[str, asyncio.Task[float]] = {}

    async def image(self, task: Task) -> float:
        """Build the task's image once (cached by content); the seconds."""
        key = f"{task.dockerfile}"
        found = self._builds.get(key)
        if found is None:

            async def build() -> float:
                t0 = time.monotonic()
                opts = Options(task.image_tag, step_timeout=task.build_timeout)
                builder = Builder(self.client, task.dockerfile.parent, opts)
                await builder.build(task.dockerfile.read_text())
                return time.monotonic() - t0

            found = self._builds[key] = asyncio.get_running_loop().create_task(build())
        return await asyncio.shield(found)

    async def trial(self, task: Task, agent: Agent = oracle) -> TrialResult:
        out = TrialResult(task.name)
        t0 = time.monotonic()
        sbx: AsyncSandbox | None = None
        try:
            out.build_s = await self.image(task)
            sbx = await self.client.sandboxes.create(
                image=task.image_tag, cpu=task.cpus, memory=task.memory_mb * 2**20,
                disk=task.storage_mb * 2**20, network=network(task), env=task.env or None,
                ttl=task.agent_timeout + task.verifier_timeout + 600, idle_timeout=None,
                labels={**self.labels, "task": task.image_tag.split(":")[0][:63]},
            )  # fmt: skip
            for d in LOGS:
                await sbx.files.make_dir(d)
            t1 = time.monotonic()
            await agent(sbx, task)
            out.agent_s = time.monotonic() - t1
            t2 = time.monotonic()
            out.rewards = await self._verify(sbx, task)
            out.verify_s = time.monotonic() - t2
        except CorralError as exc:
            out.error = f"{type(exc).__name__}: {exc.message}"[:2000]
        finally:
            if sbx is not None:
                await sbx.close()
            out.wall_s = time.monotonic() - t0
        return out

    async def _verify(self, sbx: AsyncSandbox, task: Task) -> dict[str, float]:
        await sbx.files.upload_tar(TESTS, tar_dir(task.path / "tests"))
        await sbx.commands.run(
            f"rm -f {REWARD_TXT} {REWARD_JSON}; chmod +x {TESTS}/test.sh; "
            f"{TESTS}/test.sh > /logs/verifier/test-stdout.txt 2>&1",
            timeout=task.verifier_timeout, user="root",
        )  # fmt: skip
        if await sbx.files.exists(REWARD_JSON):
            doc = json.loads(await sbx.files.read(REWARD_JSON))
            if not isinstance(doc, dict):
                raise InvalidArgument("reward.json", "must map names to numbers", doc)
            return {str(k): _finite(v, "reward.json") for k, v in doc.items()}
        if await sbx.files.exists(REWARD_TXT):
            text = (await sbx.files.read(REWARD_TXT)).decode(errors="replace").strip()
            try:
                return {"reward": _finite(float(text), "reward.txt")}
            except ValueError:
                raise InvalidArgument("reward.txt", "must hold one number", text[:100]) from None
        log = await sbx.files.read("/logs/verifier/test-stdout.txt")
        raise InvalidArgument("verifier", "wrote no /logs/verifier/reward.txt or reward.json",
                              log.decode(errors="replace")[-1000:])  # fmt: skip

    async def run_all(
        self,
        tasks: list[Task],
        agent: Agent = oracle,
        *,
        attempts: int = 1,
        concurrency: int = 8,
        on_done: Callable[[TrialResult], None] | None = None,
    ) -> list[TrialResult]:
        gate = asyncio.Semaphore(concurrency)

        async def one(task: Task) -> TrialResult:
            async with gate:
                result = await self.trial(task, agent)
            if on_done is not None:
                on_done(result)
            return result

        return list(await asyncio.gather(*(one(t) for t in tasks for _ in range(attempts))))


def _finite(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidArgument(where, "must hold finite numbers", value)
    return float(value)
