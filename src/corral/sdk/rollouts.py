"""Rollouts: an agent's trajectory as a durable log of steps.

A rollout is a named sequence of steps on one or more sandboxes. Every call
made through a rollout handle (create a sandbox, run a command, read or
write a file, record the policy's output) gets the next step number, and
its result is logged in the state store before the call returns.

Fast-forward resume: a trainer that dies and runs the same rollout code
again opens the rollout by name; every step already logged returns its
logged result without running, and the first step not logged runs live.
That step may have been in flight when the trainer died; it is resolved
exactly once:

- a command carries the key ``<rollout>.<step>``: the node runs a key at
  most once, so a command that finished returns its recorded result, one
  still running is waited for, one that never started runs now, and one
  whose agent died mid-run raises Ambiguous (node/keyed.py);
- a create carries the same key as its idempotency key;
- file writes and reads, closes and recorded values are safe to do again
  (writing the same bytes twice leaves what writing them once does).

A replayed step must make the call that was logged: another call or other
arguments (the trainer's code changed) is refused, naming the step.
"""

from __future__ import annotations

import base64
import builtins
import dataclasses
import hashlib
import inspect
import json
import re
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from corral import labels
from corral.api.models import (
    ROLLOUT_NAME,
    ROLLOUT_NAME_RULE,
    RolloutReport,
    RolloutStep,
    SandboxInfo,
    SavedState,
)
from corral.api.service import SandboxService
from corral.api.verdict import Rules
from corral.errors import (
    Ambiguous,
    CorralError,
    InternalError,
    InvalidArgument,
    SandboxClosed,
    SandboxLost,
    SandboxNotFound,
    Unavailable,
    error_from_wire,
)
from corral.sdk.commands import CommandResult
from corral.sdk.request import create_request
from corral.sdk.sandbox import AsyncSandbox

# Errors that say nothing about the step's own outcome (the platform was
# unreachable, the node died): not logged, so the step is tried again.
_TRANSIENT = (Unavailable, SandboxLost, InternalError, Ambiguous)


def _digest(op: str, args: Any) -> str:
    body = json.dumps([op, args], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(body.encode()).hexdigest()


class AsyncRollouts:
    """client.rollouts"""

    def __init__(self, ready: Callable[[], Awaitable[SandboxService]]) -> None:
        self._ready = ready  # the client's started service

    async def open(self, name: str | None = None) -> AsyncRollout:
        """The rollout `name` (a new one if none is given or none is
        logged), fast-forwarding through whatever its log holds."""
        name = name or f"rollout-{secrets.token_hex(8)}"
        if not ROLLOUT_NAME.fullmatch(name):
            raise InvalidArgument("name", ROLLOUT_NAME_RULE, name)
        service = await self._ready()
        return AsyncRollout(service, name, await service.rollout_steps(name))

    async def resume(self, state: dict[str, Any]) -> AsyncRollout:
        """Reattach to a rollout from what AsyncRollout.state() returned
        (the same as open(state["name"]), checked against the log)."""
        name = state.get("name")
        if not isinstance(name, str):
            raise InvalidArgument("state.name", "must be the rollout's name", name)
        rollout = await self.open(name)
        step = state.get("step", 0)
        if not isinstance(step, int) or step > len(rollout._log):
            raise InvalidArgument(
                "state.step",
                f"must be at most the steps logged for {name!r} ({len(rollout._log)})",
                step,
            )
        return rollout

    async def delete(self, name: str) -> None:
        """Drop a finished rollout's log (its sandboxes are the caller's)."""
        service = await self._ready()
        await service.rollout_delete(name)

    async def report(self, name: str, rules: Rules | None = None) -> RolloutReport:
        """The misbehaviour report of every sandbox the rollout created,
        open or closed, judged by the node's rules or by `rules`: filter a
        trajectory's reward on its verdict."""
        if not ROLLOUT_NAME.fullmatch(name):
            raise InvalidArgument("name", ROLLOUT_NAME_RULE, name)
        service = await self._ready()
        report = await service.rollout_report(name)
        return rules.judge(report) if rules is not None else report


class AsyncRollout:
    def __init__(self, service: SandboxService, name: str, log: builtins.list[RolloutStep]):
        self._service = service
        self.name = name
        self._log = {s.step: s for s in log}
        self.step = 0  # the next step's number
        self.sandboxes: builtins.list[str] = []
        self.checkpoints: builtins.list[dict[str, Any]] = []

    @property
    def replaying(self) -> bool:
        """Whether the next step comes from the log rather than running."""
        return self.step in self._log

    @property
    def logged(self) -> int:
        return len(self._log)

    def state(self) -> dict[str, Any]:
        """What a trainer needs to reattach (AsyncRollouts.resume): the
        rollout's name, its step, its sandboxes and checkpoints."""
        return {
            "name": self.name,
            "step": self.step,
            "sandboxes": list(self.sandboxes),
            "checkpoints": list(self.checkpoints),
        }

    def _key(self, step: int) -> str:
        return f"{self.name}.{step}"

    async def _step(
        self,
        op: str,
        args: Any,
        live: Callable[[int], Awaitable[Any]],
        encode: Callable[[Any], Any] = lambda x: x,
        decode: Callable[[Any], Any] = lambda x: x,
    ) -> Any:
        """Step `self.step`: from the log if logged, else run `live(step)`
        and log what it returned (encoded as JSON) before returning it."""
        n = self.step
        digest = _digest(op, args)
        logged = self._log.get(n)
        if logged is not None:
            if (logged.op, logged.digest) != (op, digest):
                raise InvalidArgument(
                    "step",
                    f"must make the call rollout {self.name!r} logged at this step "
                    f"({logged.op}), with the same arguments; this replay makes {op}"
                    f"{'' if logged.op != op else ' with other arguments'} "
                    "(the trainer's code or inputs changed)",
                    n,
                )
            self.step += 1
            doc = logged.result
            if isinstance(doc, dict) and "error" in doc:
                raise error_from_wire(doc["error"])
            return decode(doc["value"])
        try:
            value = await live(n)
        except _TRANSIENT:
            raise  # nothing is known of the step: it is tried again next time
        except CorralError as exc:
            await self._append(n, op, digest, {"error": exc.to_wire()})
            raise
        await self._append(n, op, digest, {"value": encode(value)})
        return value

    async def _append(self, n: int, op: str, digest: str, result: Any) -> None:
        step = RolloutStep(step=n, op=op, digest=digest, result=result)
        await self._service.rollout_append(self.name, step)
        self._log[n] = step
        self.step = n + 1

    # ------------------------------------------------------------ steps

    async def create(self, **spec: Any) -> AsyncRolloutSandbox:
        """Create a sandbox as step n (client.sandboxes.create()'s
        arguments); replayed, the same sandbox, re-attached."""
        req = create_request(**spec)
        args = req.model_dump(mode="json", exclude={"idempotency_key"})

        async def live(n: int) -> str:
            # Labelled after the digest (a log made before the label replays).
            labelled = {**req.labels, labels.ROLLOUT: self.name}
            keyed = req.model_copy(update={"idempotency_key": self._key(n), "labels": labelled})
            return (await self._service.create(keyed)).id

        sandbox_id = await self._step("create", args, live)
        return await self._attach(sandbox_id)

    async def attach(self, sandbox_id: str) -> AsyncRolloutSandbox:
        """Use a sandbox made elsewhere in this rollout (a step: replayed,
        the same id must come back)."""

        async def live(n: int) -> str:
            return sandbox_id

        await self._step("attach", sandbox_id, live)
        return await self._attach(sandbox_id)

    async def _attach(self, sandbox_id: str) -> AsyncRolloutSandbox:
        info = await self._moved(sandbox_id)
        if info.id not in self.sandboxes:
            self.sandboxes.append(info.id)
        return AsyncRolloutSandbox(self, AsyncSandbox(self._service, info), logged_id=sandbox_id)

    async def _moved(self, sandbox_id: str) -> SandboxInfo:
        """The sandbox a logged id names now: itself, or, once it was saved
        and restored elsewhere (a preempted job moved to other nodes), the
        live sandbox restored from it (labelled corral.restored_from), and
        so on down the chain. Its keyed commands' records moved with it."""
        seen = {sandbox_id}
        current = sandbox_id
        for _ in range(16):
            try:
                info = await self._service.get(current)
                if info.state.value not in ("closed", "failed"):
                    return info
            except (SandboxNotFound, SandboxClosed):
                pass
            found = await self._service.list({labels.RESTORED_FROM: current})
            live = [i for i in found if i.id not in seen]
            if not live:
                break
            current = live[0].id
            seen.add(current)
        return await self._service.get(sandbox_id)  # raises what the first id is

    async def record(self, op: str, fn: Callable[[], Any], *, args: Any = None) -> Any:
        """A step computed by the trainer (the policy's action, a reward):
        live, call `fn()` (awaited if it returns an awaitable) and log its
        JSON value; replayed, the logged value. `args` (JSON) is what the
        step depends on, checked at replay."""
        if not re.fullmatch(r"[A-Za-z0-9._:-]{1,48}", op):
            raise InvalidArgument("op", "must be 1-48 letters, digits and . _ : -", op)

        async def live(n: int) -> Any:
            value = fn()
            if inspect.isawaitable(value):
                value = await value
            json.dumps(value)  # refused now, not at replay
            return value

        return await self._step(f"record:{op}", args, live)

    async def checkpoint(self, sandbox: AsyncRolloutSandbox, store: str = "local") -> SavedState:
        """Save a sandbox to an object store as a step; in state() after."""
        from corral.api.models import SaveRequest

        async def live(n: int) -> dict[str, Any]:
            req = SaveRequest(store=store)
            saved = await self._service.save(sandbox.id, req)
            return saved.model_dump(mode="json")

        doc = await self._step("checkpoint", [sandbox.logged_id, store], live)
        self.checkpoints.append(doc)
        return SavedState.model_validate(doc)


class AsyncRolloutSandbox:
    """A sandbox whose calls are a rollout's steps."""

    def __init__(
        self, rollout: AsyncRollout, sandbox: AsyncSandbox, logged_id: str | None = None
    ) -> None:
        self.rollout = rollout
        self.sandbox = sandbox
        # The id the log knows it by (its steps' arguments name it): the
        # first one, even once it moved to another node under a new id.
        self.logged_id = logged_id or sandbox.id
        self.commands = AsyncRolloutCommands(self)
        self.files = AsyncRolloutFiles(self)

    @property
    def id(self) -> str:
        return self.sandbox.id

    async def close(self) -> None:
        async def live(n: int) -> None:
            await self.sandbox.close()

        await self.rollout._step("close", self.logged_id, live)


class AsyncRolloutCommands:
    def __init__(self, sandbox: AsyncRolloutSandbox) -> None:
        self._sbx = sandbox

    async def run(
        self,
        cmd: str | builtins.list[str],
        *,
        timeout: float | None = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        stdin: str | None = None,
    ) -> CommandResult:
        """commands.run() as a step, run at most once (its key is the step)."""
        sbx, rollout = self._sbx.sandbox, self._sbx.rollout
        args = {"sandbox": self._sbx.logged_id, "cmd": cmd, "timeout": timeout, "cwd": cwd,
                "env": env, "user": user, "stdin": stdin}  # fmt: skip

        async def live(n: int) -> CommandResult:
            try:
                return await sbx.commands.run(
                    cmd, timeout=timeout, cwd=cwd, env=env, user=user, stdin=stdin,
                    key=rollout._key(n),
                )  # fmt: skip
            except CorralError as exc:
                partial = getattr(exc, "result", None)  # a CommandTimeout's
                if partial is not None:
                    exc.details["result"] = dataclasses.asdict(partial)
                raise

        result: CommandResult = await rollout._step(
            "commands.run", args, live, dataclasses.asdict, lambda d: CommandResult(**d)
        )
        return result


class AsyncRolloutFiles:
    def __init__(self, sandbox: AsyncRolloutSandbox) -> None:
        self._sbx = sandbox

    async def write(self, path: str, data: bytes | str, *, mode: int = 0o644) -> int:
        sbx = self._sbx.sandbox
        raw = data.encode() if isinstance(data, str) else data
        args = [self._sbx.logged_id, path, hashlib.sha256(raw).hexdigest(), mode]

        async def live(n: int) -> int:
            return await sbx.files.write(path, raw, mode=mode)

        written: int = await self._sbx.rollout._step("files.write", args, live)
        return written

    async def read(self, path: str) -> bytes:
        sbx = self._sbx.sandbox

        async def live(n: int) -> bytes:
            return await sbx.files.read(path)

        data: bytes = await self._sbx.rollout._step(
            "files.read",
            [self._sbx.logged_id, path],
            live,
            lambda b: base64.b64encode(b).decode(),
            base64.b64decode,
        )
        return data

    async def read_text(self, path: str) -> str:
        return (await self.read(path)).decode()
