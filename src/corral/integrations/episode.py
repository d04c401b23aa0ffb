"""One agent episode on one stateful Corral sandbox: the core every
framework adapter shares.

An episode creates its sandbox, runs the task's setup, then takes actions
(shell commands, file writes and edits, reads) one at a time, keeping the
sandbox's shell state and files between them, until the agent submits or
runs out of steps; the reward is the task's test command run inside the
sandbox (exit 0: 1.0, else 0.0). Closing it closes the sandbox.

Invariants:
- act() never raises for what the model did: a bad action, a failed
  command, a missing file, a closed episode all come back as an
  observation the model can read (a trainer must not crash on them).
  Only the platform failing (the server gone) raises, as CorralError.
- One action at a time per episode (a lock): frameworks that run a turn's
  tool calls concurrently still see them applied in some order, never
  interleaved.
- The reward is computed once; later calls return the same value.
"""

from __future__ import annotations

import asyncio
import inspect
import posixpath
import time
from dataclasses import dataclass, field
from typing import Any

from corral.errors import (
    CommandTimeout,
    Conflict,
    FileError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SandboxClosed,
    SandboxFailed,
    SandboxLost,
    SandboxNotFound,
)
from corral.integrations.actions import Action, ActionError, Edit, Read, Shell, Submit, Write
from corral.sdk.client import AsyncClient
from corral.sdk.request import create_request
from corral.sdk.sandbox import AsyncSandbox

# What an action's failure means. The agent's doing, told to it: a missing
# file or program, a refused path, a limit hit, a timeout. The end of the
# episode: its sandbox is gone (closed, its TTL, killed, its node lost).
# Anything else (the server unreachable, an internal error) is the
# platform's and raises.
_MISTAKES = (
    NotFound,
    FileError,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Conflict,
    CommandTimeout,
)
_GONE = (SandboxClosed, SandboxNotFound, SandboxFailed, SandboxLost)
_SANDBOX_FIELDS = frozenset(inspect.signature(create_request).parameters)


@dataclass(frozen=True)
class EpisodeSpec:
    """A task: the sandbox to start (create()'s keyword arguments), where
    the agent works, how it is set up and how it is graded."""

    sandbox: dict[str, Any]
    workdir: str = "/workspace"
    setup: tuple[str, ...] = ()
    test: str | None = None
    max_steps: int = 20
    command_timeout: float = 60.0
    observation_limit: int = 8000

    @classmethod
    def from_config(cls, config: dict[str, Any], *, prefix: str = "") -> EpisodeSpec:
        """A spec from a framework's flat config: create()'s fields (image,
        workspace, toolkit, cpu, memory, network, labels, ttl, ...) beside the
        episode's own. An unknown field is refused by name (a typo in a YAML
        file should not silently start the wrong sandbox)."""
        own = {f for f in cls.__dataclass_fields__ if f != "sandbox"}
        sandbox: dict[str, Any] = {}
        episode: dict[str, Any] = {}
        for key, value in config.items():
            if key in own:
                episode[key] = value
            elif key in _SANDBOX_FIELDS:
                sandbox[key] = value
            else:
                known = ", ".join(sorted(own | _SANDBOX_FIELDS))
                raise InvalidArgument(f"{prefix}{key}", f"is not a known field ({known})", value)
        if "image" not in sandbox:
            raise InvalidArgument(f"{prefix}image", "is required", None)
        if "setup" in episode:
            setup = episode["setup"]
            if isinstance(setup, str):
                setup = [setup]
            if not isinstance(setup, (list, tuple)) or not all(isinstance(s, str) for s in setup):
                raise InvalidArgument(f"{prefix}setup", "must be a list of commands", setup)
            episode["setup"] = tuple(setup)
        spec = cls(sandbox=sandbox, **episode)
        spec.check(prefix)
        create_request(**sandbox)  # the sandbox fields' own checks, now, by name
        return spec

    def check(self, prefix: str = "") -> None:
        if not isinstance(self.max_steps, int) or not 1 <= self.max_steps <= 10_000:
            raise InvalidArgument(f"{prefix}max_steps", "must be 1-10000", self.max_steps)
        if not isinstance(self.command_timeout, (int, float)) or self.command_timeout <= 0:
            raise InvalidArgument(
                f"{prefix}command_timeout",
                "must be a positive number of seconds",
                self.command_timeout,
            )
        if not isinstance(self.observation_limit, int) or self.observation_limit < 256:
            raise InvalidArgument(
                f"{prefix}observation_limit",
                "must be at least 256 characters",
                self.observation_limit,
            )
        if not isinstance(self.workdir, str) or not self.workdir.startswith("/"):
            raise InvalidArgument(f"{prefix}workdir", "must be an absolute path", self.workdir)
        if self.test is not None and not isinstance(self.test, str):
            raise InvalidArgument(f"{prefix}test", "must be a command (a string)", self.test)


@dataclass
class Step:
    """What one action gave: the model's observation, whether the episode
    is over, and the reward if it is."""

    observation: str
    done: bool = False
    reward: float | None = None
    ok: bool = True  # False: the action failed (bad action, non-zero exit, missing file)
    truncated: bool = False  # over because the step limit was reached, not submitted
    seconds: float = 0.0  # the whole step, as the adapter saw it
    command_s: float = 0.0  # of which the command ran in the sandbox (its own clock)
    # When graded: the sandbox's misbehaviour verdict (clean, suspicious,
    # violation) on what the agent did before the test ran (docs/report.md).
    verdict: str | None = None


@dataclass
class EpisodeStats:
    steps: int = 0
    errors: int = 0
    create_s: float = 0.0
    step_s: list[float] = field(default_factory=list)


def clip(text: str, limit: int) -> str:
    """The head and tail of `text` within `limit` characters: errors are
    often at the end, the command's first lines at the start."""
    if len(text) <= limit:
        return text
    marker = f"\n[... {len(text) - limit} characters cut ...]\n"
    half = max(0, (limit - len(marker)) // 2)
    return text[:half] + marker + text[len(text) - half :]


class AsyncEpisode:
    def __init__(
        self, client: AsyncClient, spec: EpisodeSpec, *, labels: dict[str, str] | None = None
    ) -> None:
        self.client = client
        self.spec = spec
        self.labels = labels or {}
        self.sandbox: AsyncSandbox | None = None
        self.stats = EpisodeStats()
        self.closed = False
        self._reward: float | None = None
        self._lock = asyncio.Lock()

    @property
    def done(self) -> bool:
        return self.closed or self._reward is not None

    async def start(self) -> None:
        """Create the sandbox and run the task's setup. Raises CorralError
        (an unknown image, a refused spec, a setup that failed) with
        nothing left behind."""
        t0 = time.monotonic()
        fields = dict(self.spec.sandbox)
        fields["labels"] = {**(fields.get("labels") or {}), **self.labels}
        self.sandbox = await self.client.sandboxes.create(**fields)
        try:
            await self.sandbox.files.make_dir(self.spec.workdir)
            for command in self.spec.setup:
                r = await self.sandbox.commands.run(
                    command, cwd=self.spec.workdir, timeout=max(self.spec.command_timeout, 300)
                )
                if r.exit_code != 0:
                    raise InvalidArgument(
                        "setup", f"a command exited {r.exit_code}: {clip(r.stderr, 2000)}", command
                    )
        except BaseException:
            await self.close()
            raise
        self.stats.create_s = time.monotonic() - t0

    async def act(self, action: Action | ActionError) -> Step:
        async with self._lock:
            t0 = time.monotonic()
            step = await self._act(action)
            step.seconds = time.monotonic() - t0
            if not step.ok:
                self.stats.errors += 1
            self.stats.step_s.append(step.seconds)
            return step

    async def _act(self, action: Action | ActionError) -> Step:
        if self.closed or self.sandbox is None:
            return Step("error: this episode is over: its sandbox was closed", True, 0.0, ok=False)
        if self._reward is not None:
            return Step("error: this episode is over: it was graded", True, self._reward, ok=False)
        if isinstance(action, ActionError):
            self.stats.steps += 1
            return await self._maybe_out(Step(action.message, ok=False))
        if isinstance(action, Submit):
            return await self._grade("submitted")
        self.stats.steps += 1
        try:
            step = await self._do(self.sandbox, action)
        except _GONE as exc:
            self.closed = True
            return Step(f"error: the sandbox is gone ({exc.message})", True, 0.0, ok=False)
        except _MISTAKES as exc:
            step = Step(f"error: {exc.message}", ok=False)
        return await self._maybe_out(step)

    async def _maybe_out(self, step: Step) -> Step:
        """After the last allowed step the episode is graded."""
        if self.stats.steps < self.spec.max_steps:
            return step
        graded = await self._grade(f"the step limit ({self.spec.max_steps}) was reached")
        graded.observation = f"{step.observation}\n{graded.observation}"
        graded.ok = step.ok
        graded.truncated = True
        graded.command_s += step.command_s
        return graded

    def _path(self, path: str) -> str:
        return posixpath.normpath(posixpath.join(self.spec.workdir, path))

    async def _do(self, sbx: AsyncSandbox, action: Action) -> Step:
        limit = self.spec.observation_limit
        if isinstance(action, Shell):
            r = await sbx.commands.run(
                action.command,
                cwd=self.spec.workdir,
                timeout=min(action.timeout or self.spec.command_timeout, self.spec.command_timeout),
                stdout_limit=4 * limit,
                stderr_limit=4 * limit,
            )
            text = r.stdout + (f"\n[stderr]\n{r.stderr}" if r.stderr else "")
            observation = clip(f"exit code {r.exit_code}\n{text}", limit)
            return Step(observation, ok=r.exit_code == 0, command_s=r.duration)
        if isinstance(action, Read):
            data = await sbx.files.read(self._path(action.path))
            return Step(clip(data.decode(errors="replace"), limit))
        if isinstance(action, Write):
            n = await sbx.files.write(self._path(action.path), action.content)
            return Step(f"wrote {n} bytes to {action.path}")
        assert isinstance(action, Edit)
        path = self._path(action.path)
        text = (await sbx.files.read(path)).decode(errors="replace")
        count = text.count(action.old)
        if count != 1:
            why = "was not found" if count == 0 else f"appears {count} times (give more context)"
            return Step(f"error: the text to replace {why} in {action.path}", ok=False)
        await sbx.files.write(path, text.replace(action.old, action.new))
        return Step(f"edited {action.path}")

    async def _grade(self, why: str) -> Step:
        verdict = await self._verdict()
        reward, detail, test_s = await self._score()
        step = Step(f"{why}; reward {reward:g}\n{detail}".rstrip(), True, reward, command_s=test_s)
        step.verdict = verdict
        return step

    async def _verdict(self) -> str | None:
        """The report's verdict before the test runs: the agent's doing only."""
        if self.sandbox is None or self.closed or self._reward is not None:
            return None
        try:
            return (await self.sandbox.audit()).verdict
        except _GONE:
            return None

    async def _score(self) -> tuple[float, str, float]:
        """The reward, what the test said, and how long it ran."""
        if self._reward is not None:
            return self._reward, "", 0.0
        if self.sandbox is None or self.closed:
            self._reward = 0.0
            return 0.0, "the sandbox was closed", 0.0
        if self.spec.test is None:
            self._reward = 0.0
            return 0.0, "the task has no test", 0.0
        try:
            r = await self.sandbox.commands.run(
                self.spec.test, cwd=self.spec.workdir, timeout=max(self.spec.command_timeout, 600)
            )
        except CommandTimeout as exc:
            self._reward = 0.0
            return 0.0, f"the test timed out: {exc.message}", 0.0
        self._reward = 1.0 if r.exit_code == 0 else 0.0
        tail = clip(r.stdout + r.stderr, 1000)
        return self._reward, f"test exit code {r.exit_code}\n{tail}", r.duration

    async def reward(self) -> float:
        """Grade now if not yet graded (an episode cut short by its
        framework still gets a reward)."""
        async with self._lock:
            return (await self._score())[0]

    async def close(self) -> None:
        """Close the sandbox; idempotent, and safe on a sandbox already gone."""
        if self.closed:
            return
        self.closed = True
        if self.sandbox is not None:
            try:
                await self.sandbox.close()
            except (SandboxClosed, SandboxNotFound):
                pass
