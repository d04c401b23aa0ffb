"""Commands in a sandbox: run to completion, or start in the background."""

from __future__ import annotations

import asyncio
import codecs
import inspect
import signal as signals
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from corral.api.models import ExecExit, ExecOutput, ExecRequest, ExecStarted, validated
from corral.errors import CommandTimeout, SandboxFailed
from corral.sdk.handle import SandboxHandle

OutputCallback = Callable[[str], Any] | Callable[[str], Awaitable[Any]]
MiB = 1024 * 1024


@dataclass(frozen=True)
class CommandResult:
    """How a command ended. Output beyond its limit is counted, not kept."""

    pid: int
    exit_code: int
    stdout: str
    stderr: str
    truncated: bool
    duration: float
    signal: int = 0
    timed_out: bool = False
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    cpu_user: float = 0.0
    cpu_system: float = 0.0
    max_rss: int = 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class _Collector:
    """Gathers a command's events, feeding callbacks as output arrives."""

    def __init__(self, on_stdout: OutputCallback | None, on_stderr: OutputCallback | None) -> None:
        self.callbacks = {"stdout": on_stdout, "stderr": on_stderr}
        self.decoders = {
            "stdout": codecs.getincrementaldecoder("utf-8")(errors="replace"),
            "stderr": codecs.getincrementaldecoder("utf-8")(errors="replace"),
        }
        self.parts: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self.pid = 0
        self.exit: ExecExit | None = None

    async def feed(self, event: ExecStarted | ExecOutput | ExecExit) -> None:
        if isinstance(event, ExecStarted):
            self.pid = event.pid
        elif isinstance(event, ExecOutput):
            await self._text(event.type, self.decoders[event.type].decode(event.data))
        else:
            for stream, dec in self.decoders.items():
                await self._text(stream, dec.decode(b"", final=True))
            self.exit = event

    async def _text(self, stream: str, text: str) -> None:
        if not text:
            return
        self.parts[stream].append(text)
        cb = self.callbacks[stream]
        if cb is not None:
            out = cb(text)
            if inspect.isawaitable(out):
                await out

    def result(self, limits: tuple[int, int]) -> CommandResult:
        x = self.exit
        if x is None:
            raise SandboxFailed(f"command {self.pid} ended without an exit status")
        return CommandResult(
            pid=self.pid,
            exit_code=x.exit_code,
            stdout="".join(self.parts["stdout"]),
            stderr="".join(self.parts["stderr"]),
            truncated=x.stdout_bytes > limits[0] or x.stderr_bytes > limits[1],
            duration=x.duration,
            signal=x.signal,
            timed_out=x.timed_out,
            stdout_bytes=x.stdout_bytes,
            stderr_bytes=x.stderr_bytes,
            cpu_user=x.cpu_user,
            cpu_system=x.cpu_system,
            max_rss=x.max_rss,
        )


def _finish(collector: _Collector, req: ExecRequest) -> CommandResult:
    result = collector.result((req.stdout_limit, req.stderr_limit))
    if result.timed_out:
        err = CommandTimeout(
            f"command timed out after {req.timeout}s and was killed with its process tree: "
            f"{_short(req.cmd)}",
            timeout=req.timeout,
            pid=result.pid,
        )
        err.result = result  # type: ignore[attr-defined]
        raise err
    return result


def _short(cmd: str | list[str]) -> str:
    text = cmd if isinstance(cmd, str) else " ".join(cmd)
    return text if len(text) <= 120 else text[:117] + "..."


class AsyncCommandHandle:
    """A command started in the background."""

    def __init__(
        self,
        sandbox: SandboxHandle,
        events: AsyncIterator[Any],
        collector: _Collector,
        req: ExecRequest,
    ) -> None:
        self._sandbox = sandbox
        self._collector = collector
        self._req = req
        self._task = asyncio.create_task(self._drain(events))
        # An error (the sandbox closed under a background command) is seen by
        # wait(); nobody waiting must not be reported as a lost exception.
        self._task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _drain(self, events: AsyncIterator[Any]) -> None:
        async for ev in events:
            await self._collector.feed(ev)

    @property
    def pid(self) -> int:
        return self._collector.pid

    @property
    def stdout(self) -> str:
        """Output so far."""
        return "".join(self._collector.parts["stdout"])

    @property
    def stderr(self) -> str:
        return "".join(self._collector.parts["stderr"])

    @property
    def done(self) -> bool:
        return self._task.done()

    async def wait(self, timeout: float | None = None) -> CommandResult:
        """Wait for the command to end. `timeout` bounds this wait only (it
        raises TimeoutError and leaves the command running)."""
        async with asyncio.timeout(timeout):
            await asyncio.shield(self._task)
        return _finish(self._collector, self._req)

    async def kill(self, signal: int = signals.SIGKILL) -> None:
        if self._task.done():
            return
        await self._sandbox._service.kill(self._sandbox.id, self.pid, signal)


class AsyncCommands:
    def __init__(self, sandbox: SandboxHandle) -> None:
        self._sandbox = sandbox

    def _request(
        self, cmd: str | list[str], background: bool, timeout: float | None, **kw: Any
    ) -> ExecRequest:
        fields: dict[str, Any] = {"cmd": cmd, "background": background, "timeout": timeout}
        fields.update({k: v for k, v in kw.items() if v is not None})  # None: the default
        return validated(ExecRequest, fields)

    async def run(
        self,
        cmd: str | list[str],
        *,
        timeout: float | None = 60.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        stdin: bytes | str | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        stdout_limit: int = MiB,
        stderr_limit: int = MiB,
        key: str | None = None,
        cpu_class: str | None = None,
    ) -> CommandResult:
        """Run a command to its end. A string runs through the platform's
        own static bash (`bash -c`; programs still come from the image's
        PATH), a list runs as given. `user` (a name, a uid, or uid:gid)
        defaults to the image's user, else root; without a gid the
        command also has the user's groups from the image's /etc/group
        (as runc's exec). Raises CommandTimeout (a
        TimeoutError) after killing the command's whole process tree.

        With `key`, the command runs at most once in this sandbox: running
        the same key again (after a lost connection, a restarted caller)
        returns the first run's result, waiting for it if it still runs;
        Ambiguous if it started under an agent that died before it ended.

        `cpu_class` ("interactive" or "background") overrides the
        sandbox's for this command (docs/cpu-classes.md)."""
        req = self._request(
            cmd,
            False,
            timeout,
            cwd=cwd,
            env=env,
            user=user,
            stdin=stdin.encode() if isinstance(stdin, str) else stdin,
            stdout_limit=stdout_limit,
            stderr_limit=stderr_limit,
            key=key,
            cpu_class=cpu_class,
        )
        collector = _Collector(on_stdout, on_stderr)
        async for ev in self._sandbox._service.exec(self._sandbox.id, req):
            await collector.feed(ev)
        return _finish(collector, req)

    async def start(
        self,
        cmd: str | list[str],
        *,
        timeout: float | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        user: str | None = None,
        stdin: bytes | str | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        stdout_limit: int = MiB,
        stderr_limit: int = MiB,
        cpu_class: str | None = None,
    ) -> AsyncCommandHandle:
        """Start a command and return once it runs (its pid is known).
        `cpu_class` as for run()."""
        req = self._request(
            cmd,
            True,
            timeout,
            cwd=cwd,
            env=env,
            user=user,
            stdin=stdin.encode() if isinstance(stdin, str) else stdin,
            stdout_limit=stdout_limit,
            stderr_limit=stderr_limit,
            cpu_class=cpu_class,
        )
        collector = _Collector(on_stdout, on_stderr)
        events = aiter(self._sandbox._service.exec(self._sandbox.id, req))
        await collector.feed(await anext(events))  # the started event: pid
        return AsyncCommandHandle(self._sandbox, events, collector, req)

    async def kill(self, pid: int, signal: int = signals.SIGKILL) -> None:
        """Signal a command's process group by pid (e.g. one started from
        another process)."""
        await self._sandbox._service.kill(self._sandbox.id, pid, signal)

    async def kill_all(self, signal: int = signals.SIGKILL) -> None:
        """Signal every process in the sandbox (its init excepted): clears
        runaway background work, even a fork bomb at the pids limit."""
        await self._sandbox._service.kill(self._sandbox.id, 0, signal)
