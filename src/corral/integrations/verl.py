"""verl tools (`pip install corral[verl]`): a stateful sandbox per
trajectory, and stateless code execution as function calls.

Registered in a verl multi-turn run by a tool config (docs/integrations.md):

    tools:
      - class_name: corral.integrations.verl.CorralSandboxTool
        config: {type: native, image: debian-python:bookworm, test: "pytest -q"}
        tool_schema: ...   # optional: CorralSandboxTool.schema() is the default

verl 0.9's ToolAgentLoop calls create, execute and release around every
single tool call, with a fresh instance id each time, and has no hook at
the end of a trajectory. So the sandbox is keyed by the trajectory's
request id (`agent_data.request_id`), made on its first call, kept across
calls, and closed when the agent submits, when `end(request_id)` is
called, or after `idle_release` seconds without a call (a trajectory cut
short by its length limit never submits). A caller that gives no
agent_data gets the classic contract: one sandbox per instance id, closed
by release().

Whatever the model sends, execute() answers with a ToolResponse (bad JSON,
unknown fields, a failed command, an unknown image): a bad tool call is
an observation, never an exception in the trainer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from corral.errors import CorralError, InvalidArgument
from corral.integrations.actions import from_arguments
from corral.integrations.connect import client as connect
from corral.integrations.episode import AsyncEpisode, EpisodeSpec, clip
from corral.log import get_logger
from corral.sdk.client import AsyncClient

log = get_logger("corral.integrations.verl")

_SANDBOX_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "sandbox",
        "description": (
            "Act in your own Linux sandbox, which keeps its files between calls. "
            "Give `command` to run a shell command; `path` and `content` to write a file; "
            "`path`, `old` and `new` to replace text in a file; `path` alone to read a file; "
            "or `submit` true when done, to be graded by the task's tests."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "a bash command"},
                "path": {"type": "string", "description": "a file, relative to the workdir"},
                "content": {"type": "string", "description": "the whole new file"},
                "old": {"type": "string", "description": "the exact text to replace"},
                "new": {"type": "string", "description": "its replacement"},
                "submit": {"type": "boolean", "description": "true: finish and be graded"},
            },
            "required": [],
        },
    },
}

_CODE_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "run_code",
        "description": "Run a program in a fresh sandbox and see its output.",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "the program's source"},
                "language": {"type": "string", "description": "python, cpp, go, rust, ..."},
                "stdin": {"type": "string", "description": "its standard input"},
            },
            "required": ["code"],
        },
    },
}


def _connection(config: dict[str, Any]) -> tuple[dict[str, Any], str | None, str | None]:
    rest = dict(config)
    rest.pop("type", None)  # verl's own field ("native")
    return rest, rest.pop("url", None), rest.pop("api_key", None)


class CorralSandboxTool(BaseTool):  # type: ignore[misc]
    """One stateful Corral sandbox per trajectory (see the module doc)."""

    def __init__(self, config: dict[str, Any], tool_schema: Any = None) -> None:
        rest, self._url, self._api_key = _connection(config)
        self.idle_release = float(rest.pop("idle_release", 600))
        if self.idle_release <= 0:
            raise InvalidArgument(
                "idle_release", "must be a positive number of seconds", self.idle_release
            )
        self.task = rest
        self.spec = EpisodeSpec.from_config(rest)
        schema = tool_schema or OpenAIFunctionToolSchema.model_validate(self.schema())
        super().__init__(config, schema)
        self._client: AsyncClient | None = None
        self._episodes: dict[str, AsyncEpisode] = {}
        self._last_use: dict[str, float] = {}
        self._starting: dict[str, asyncio.Task[AsyncEpisode]] = {}
        self._by_instance: dict[str, str] = {}  # instance id -> its trajectory's key
        self._create_kwargs: dict[str, dict[str, Any]] = {}  # instance id -> the row's task
        self._ended: dict[str, float] = {}  # trajectories over: their reward
        self._reaper: asyncio.Task[None] | None = None

    @staticmethod
    def schema() -> dict[str, Any]:
        return _SANDBOX_SCHEMA

    def get_openai_tool_schema(self) -> Any:
        return self.tool_schema

    def _corral(self) -> AsyncClient:
        if self._client is None:
            self._client = connect(self._url, self._api_key)
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())
        return self._client

    @property
    def open_trajectories(self) -> int:
        return len(self._episodes)

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, Any]:
        """A new instance id. The dataset row's `create_kwargs` (its
        extra_info.tools_kwargs.<tool>.create_kwargs: a workspace, a test,
        setup commands, any field of the tool's config) are the task of the
        trajectory whose sandbox this call starts."""
        instance_id = instance_id or uuid.uuid4().hex
        create_kwargs = kwargs.get("create_kwargs")
        if create_kwargs:
            self._create_kwargs[instance_id] = dict(create_kwargs)
        return instance_id, ToolResponse()

    async def _episode(self, key: str, row: dict[str, Any] | None) -> AsyncEpisode:
        found = self._episodes.get(key)
        if found is not None:
            return found
        # Single flight: a turn's concurrent calls start one sandbox.
        task = self._starting.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._start(key, row))
            self._starting[key] = task
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self._starting.pop(key, None)

    async def _start(self, key: str, row: dict[str, Any] | None) -> AsyncEpisode:
        spec = self.spec
        if row:
            spec = EpisodeSpec.from_config({**self.task, **row}, prefix="create_kwargs.")
        episode = AsyncEpisode(self._corral(), spec, labels={"verl.request": key[:63]})
        await episode.start()
        self._episodes[key] = episode
        return episode

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[Any, float, dict[str, Any]]:
        agent_data = kwargs.get("agent_data")
        key = str(getattr(agent_data, "request_id", None) or instance_id)
        self._by_instance[instance_id] = key
        if key in self._ended:
            return ToolResponse(text="error: this trajectory's sandbox was closed"), 0.0, {}
        self._last_use[key] = time.monotonic()
        row = self._create_kwargs.pop(instance_id, None)
        try:
            episode = await self._episode(key, row)
        except CorralError as exc:
            return ToolResponse(text=f"error: the sandbox could not start: {exc}"), 0.0, {}
        step = await episode.act(from_arguments(parameters))
        if step.done:
            await self.end(key)
        metrics = {"corral_step_s": step.seconds, "corral_done": step.done}
        return ToolResponse(text=step.observation), step.reward or 0.0, metrics

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        key = self._by_instance.get(instance_id, instance_id)
        if key in self._ended:
            return self._ended[key]
        episode = self._episodes.get(key)
        return await episode.reward() if episode is not None else 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._create_kwargs.pop(instance_id, None)
        key = self._by_instance.pop(instance_id, instance_id)
        if key == instance_id:  # no trajectory id: the instance is the episode
            await self.end(key)

    async def end(self, request_id: str, *, forget: bool = False) -> float:
        """Close a trajectory's sandbox; its reward (graded now if it never
        submitted). A later call for it is answered "closed", unless
        `forget`: the trajectory is over and its id may come again (verl's
        deterministic ids, `det-<n>`, repeat across training steps)."""
        episode = self._episodes.pop(request_id, None)
        self._last_use.pop(request_id, None)
        if episode is None:
            return self._ended.pop(request_id, 0.0) if forget else self._ended.get(request_id, 0.0)
        try:
            reward = await episode.reward()
        finally:
            await episode.close()
        if forget:
            return reward
        self._ended[request_id] = reward
        if len(self._ended) > 100_000:  # a long run's tombstones stay bounded
            for old in list(self._ended)[:50_000]:
                del self._ended[old]
        return reward

    async def aclose(self) -> None:
        """Close every open trajectory's sandbox and the client."""
        if self._reaper is not None:
            # Stopped first, and waited for: a release it has begun ends
            # (its close runs on after the cancel) while the client is open.
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None
        await asyncio.gather(*(self.end(k) for k in list(self._episodes)))
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(min(30.0, self.idle_release / 4))
            cutoff = time.monotonic() - self.idle_release
            for key in [k for k, t in self._last_use.items() if t < cutoff]:
                try:
                    await self.end(key)
                except CorralError as exc:  # one sandbox's failure stops no other release
                    log.warning("verl.release_failed", request=key, error=str(exc))


class CorralCodeTool(BaseTool):  # type: ignore[misc]
    """Stateless code execution: each call a function call on a warm
    worker (any language of docs/fncall-languages.md)."""

    def __init__(self, config: dict[str, Any], tool_schema: Any = None) -> None:
        rest, self._url, self._api_key = _connection(config)
        self.language = str(rest.pop("language", "python"))
        self.run_timeout = float(rest.pop("run_timeout", 10))
        self.observation_limit = int(rest.pop("observation_limit", 4000))
        if rest:
            key = sorted(rest)[0]
            raise InvalidArgument(
                key,
                "is not a known field (url, api_key, language, run_timeout, observation_limit)",
                rest[key],
            )
        schema = tool_schema or OpenAIFunctionToolSchema.model_validate(_CODE_SCHEMA)
        super().__init__(config, schema)
        self._client: AsyncClient | None = None

    def get_openai_tool_schema(self) -> Any:
        return self.tool_schema

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[Any, float, dict[str, Any]]:
        if not isinstance(parameters, dict) or not isinstance(parameters.get("code"), str):
            return ToolResponse(text='error: send {"code": "...", "language": "python"}'), 0.0, {}
        if self._client is None:
            self._client = connect(self._url, self._api_key)
        stdin = parameters.get("stdin")
        try:
            r = await self._client.fncall.run(
                str(parameters.get("language") or self.language),
                parameters["code"],
                stdin=stdin if isinstance(stdin, str) else None,
                run_timeout=self.run_timeout,
            )
        except CorralError as exc:
            return ToolResponse(text=f"error: {exc}"), 0.0, {}
        text = f"status: {r.status}\n"
        if r.compile_output:
            text += f"[compile]\n{r.compile_output}\n"
        text += r.stdout + (f"\n[stderr]\n{r.stderr}" if r.stderr else "")
        return ToolResponse(text=clip(text, self.observation_limit)), 0.0, {"status": r.status}

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
