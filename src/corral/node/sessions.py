"""Commands in sandboxes: each exec is a session with the sandbox's exec
server (execd/), streamed back as events, accounted in the sandbox's audit
and command log when it ends, however it ends."""

from __future__ import annotations

import asyncio
import builtins
import signal as signals
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Literal

from corral import metrics, trace
from corral.api.models import ExecEvent, ExecExit, ExecOutput, ExecRequest, ExecStarted
from corral.config import NodeConfig
from corral.errors import (
    CommandNotFound,
    CorralError,
    FileError,
    InvalidArgument,
    SandboxFailed,
    Unavailable,
)
from corral.execd import protocol as proto
from corral.execd.client import ExecdClient, ExecSession
from corral.host import platform as plat
from corral.log import get_logger
from corral.node.activity import Activity
from corral.node.audit import Audit
from corral.node.cpuclasses import BACKGROUND, INTERACTIVE, CpuClasses
from corral.node.fncall.pool import reset_worker
from corral.node.lifecycle import merge_env
from corral.node.records import Records
from corral.node.store import SandboxRecord, Store
from corral.runtimes.base import HostCommands, Runtime

log = get_logger("corral.node")

EXEC_GRACE = 10.0  # how long past its timeout the agent waits for the exec server
KILL_TIMEOUT = 5.0  # for init's answer to the kill of a command past that
# The exit of a command the agent killed itself past its timeout and grace
# (its handler stopped): killed, timed out, nothing more known of it.
OVERDUE_EXIT = proto.EXIT.pack(-1, signals.SIGKILL, 1, 0, 0, 0, 0, 0)


class Sessions:
    def __init__(
        self,
        config: NodeConfig,
        store: Store,
        records: Records,
        activity: Activity,
        audit: Audit,
        execd: Callable[[str], ExecdClient],
        cpu: CpuClasses,
        runtimes: Mapping[str, Runtime],
    ) -> None:
        self.config = config
        self.store = store
        self.records = records
        self.activity = activity
        self.audit = audit
        self._execd = execd
        self.cpu = cpu
        self.runtimes = runtimes
        self._sessions: dict[tuple[str, int], ExecSession] = {}

    def end(self, sandbox_id: str) -> None:
        """Close the sessions of a sandbox that is going away."""
        for key in [k for k in self._sessions if k[0] == sandbox_id]:
            self._sessions.pop(key).close()

    def close_all(self) -> None:
        for session in list(self._sessions.values()):
            session.close()
        self._sessions.clear()

    async def exec(self, rec: SandboxRecord, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        sandbox_id = rec.id
        argv = [plat.SHELL, "-c", req.cmd] if isinstance(req.cmd, str) else list(req.cmd)
        env = merge_env(rec.image_env, rec.spec.get("env", {}), req.env)
        if req.cpu_class is not None and not isinstance(self.runtimes.get(rec.kind), HostCommands):
            raise InvalidArgument(
                "cpu_class",
                "a command's own class needs a kind whose commands are host processes "
                "(container); give a VM its class at create",
                f"{req.cpu_class} on kind {rec.kind}",
            )
        default_class = rec.spec.get("cpu_class", INTERACTIVE)
        cpu_class = self.cpu.command_class(sandbox_id, req.cpu_class, default_class)
        t0 = time.monotonic()
        # Request to exit, with the exit code. Never made current: this is
        # an async generator, run in its consumer's context between yields.
        span = trace.start("sandbox.exec", **{"sandbox.id": sandbox_id, "sandbox.kind": rec.kind})
        # The sandbox takes the command's class before it starts: its first
        # instructions already run with the right weight and cores.
        self.cpu.begin(sandbox_id, cpu_class, default_class, rec.spec.get("cpu", 1.0))
        try:
            session = await self._execd(sandbox_id).start(
                argv,
                env,
                user=req.user or rec.image_user or "root",
                cwd=req.cwd or rec.workdir,
                timeout=req.timeout,
                stdout_cap=req.stdout_limit,
                stderr_cap=req.stderr_limit,
                stdin=req.stdin,
                stdin_open=req.stdin_open or req.pty is not None,
                pty=req.pty,
                idle=cpu_class == BACKGROUND
                and isinstance(self.runtimes.get(rec.kind), HostCommands),
                stdin_timeout=req.timeout + EXEC_GRACE if req.timeout else None,
            )
        except Unavailable:
            self.cpu.end(sandbox_id, cpu_class)
            gone = self.records.gone(sandbox_id)
            span.end(gone)
            raise gone from None
        except BaseException as exc:
            self.cpu.end(sandbox_id, cpu_class)
            span.end(exc)
            raise
        span.set("exec.pid", session.pid)
        key = (sandbox_id, session.pid)
        self._sessions[key] = session
        self.activity.begin(sandbox_id)
        self.audit.begin(sandbox_id)
        outcome = "error"
        exit_event: ExecExit | None = None
        seen = {"stdout": 0, "stderr": 0}
        over = False
        error: BaseException | None = None
        try:
            yield ExecStarted(pid=session.pid)
            # The time spent waiting on the sandbox, all events together,
            # is what is bounded (not each wait: a server trickling output
            # would then never be cut off), and not the time the consumer
            # takes between events (a slow reader is not the sandbox's doing).
            budget = req.timeout + EXEC_GRACE if req.timeout else None
            events = session.events()
            loop = asyncio.get_running_loop()
            while True:
                waited_from = loop.time()
                try:
                    async with asyncio.timeout(budget):
                        kind, payload = await anext(events)
                    if budget is not None:
                        budget = max(budget - (loop.time() - waited_from), 0.0)
                except StopAsyncIteration:
                    raise self.records.gone(sandbox_id) from None
                except TimeoutError:
                    # Its handler, which ends it at its timeout, runs as its
                    # user: the command may have stopped it (kill -STOP -1).
                    # PID 1 answers a kill itself: if it does, the command
                    # timed out like any other; if not, the server is gone.
                    if not await self._kill_overdue(sandbox_id, session.pid):
                        raise SandboxFailed(
                            f"sandbox {sandbox_id}: exec server did not end pid {session.pid} "
                            f"{EXEC_GRACE:.0f}s after its timeout",
                            sandbox=sandbox_id,
                        ) from None
                    kind, payload = proto.RSP_EXIT, OVERDUE_EXIT
                except ConnectionError:
                    raise self.records.gone(sandbox_id) from None
                if kind == proto.RSP_EXIT:
                    x = proto.parse_exit(payload)
                    dropped = max(0, x.stdout_bytes - req.stdout_limit) + max(
                        0, x.stderr_bytes - req.stderr_limit
                    )
                    if dropped:
                        metrics.OUTPUT_DROPPED.inc(dropped)
                    outcome = "timeout" if x.timed_out else "ok"
                    exit_event = ExecExit(
                        exit_code=x.exit_code,
                        signal=x.signal,
                        timed_out=x.timed_out,
                        stdout_bytes=x.stdout_bytes,
                        stderr_bytes=x.stderr_bytes,
                        cpu_user=x.cpu_user,
                        cpu_system=x.cpu_system,
                        max_rss=x.max_rss,
                        duration=time.monotonic() - t0,
                    )
                    span.set("exec.exit_code", x.exit_code)
                    span.set("exec.signal", x.signal or None)
                    span.set("exec.timed_out", x.timed_out)
                    if rec.kind == "fncall" and self.activity.running(sandbox_id) == 1:
                        # Stateless: once nothing runs, nothing of it is
                        # kept; wiped before the caller hears the exit, so
                        # its next command starts clean.
                        await self._reset_stateless(sandbox_id)
                    yield exit_event
                    return
                stream: Literal["stdout", "stderr"] = (
                    "stdout" if kind == proto.RSP_STDOUT else "stderr"
                )
                # The server caps what it captures; the host holds it to the
                # same caps whatever it says (a VM guest's root speaks for it).
                room = (req.stdout_limit if stream == "stdout" else req.stderr_limit) - seen[stream]
                if len(payload) > room:
                    payload = payload[: max(0, room)]
                    if not over:
                        over = True
                        self.store.count(sandbox_id, "replies_refused")
                seen[stream] += len(payload)
                if payload:
                    yield ExecOutput(type=stream, data=payload)
        except BaseException as exc:
            error = exc
            raise
        finally:
            span.set("exec.outcome", outcome)
            span.end(error)
            session.close()
            self._sessions.pop(key, None)
            self.cpu.end(sandbox_id, cpu_class)
            self.audit.account(sandbox_id, argv, req, outcome, exit_event, t0)
            if not self.activity.end(sandbox_id) and rec.kind == "fncall" and exit_event is None:
                await self._reset_stateless(sandbox_id)
            metrics.EXEC_TOTAL.labels(outcome).inc()
            metrics.EXEC_SECONDS.observe(time.monotonic() - t0)

    async def _kill_overdue(self, sandbox_id: str, pid: int) -> bool:
        """Kill a command past its timeout and grace; whether the sandbox's
        init took the kill."""
        try:
            async with asyncio.timeout(KILL_TIMEOUT):
                await self._execd(sandbox_id).kill(pid, signals.SIGKILL)
        except (CorralError, OSError, TimeoutError) as exc:
            log.warning("exec.overdue_kill_failed", sandbox=sandbox_id, pid=pid, error=str(exc))
            return False
        log.warning("exec.overdue_killed", sandbox=sandbox_id, pid=pid)
        return True

    async def _reset_stateless(self, sandbox_id: str) -> None:
        try:
            await reset_worker(self._execd(sandbox_id))
        except (CorralError, OSError) as exc:  # a dead reset handler: a closed connection
            log.warning("fncall.reset_failed", sandbox=sandbox_id, error=str(exc))

    async def kill(self, rec: SandboxRecord, pid: int, signal: int = signals.SIGKILL) -> None:
        """Signal a command's process group; pid 0 means every process of
        the sandbox but its init."""
        if not 0 < signal < 65:
            raise InvalidArgument("signal", "must be a signal number between 1 and 64", signal)
        if pid < 0 or pid == 1:
            raise InvalidArgument("pid", "must be a command's pid, or 0 for all processes", pid)
        self.store.count(rec.id, "commands_killed")
        session = self._sessions.get((rec.id, pid))
        if session is not None:
            await session.signal(signal)
            return
        try:
            await self._execd(rec.id).kill(pid, signal)
        except FileError as exc:
            raise CommandNotFound(
                f"no command with pid {pid} in sandbox {rec.id}", sandbox=rec.id, pid=pid
            ) from exc

    def _running(self, rec: SandboxRecord, pid: int) -> ExecSession:
        """The session of a command this node runs (started here)."""
        session = self._sessions.get((rec.id, pid))
        if session is None:
            raise CommandNotFound(
                f"no command with pid {pid} in sandbox {rec.id} started here", sandbox=rec.id,
                pid=pid,
            )  # fmt: skip
        return session

    async def resize_pty(self, rec: SandboxRecord, pid: int, rows: int, cols: int) -> None:
        if not (1 <= rows <= 1000 and 1 <= cols <= 1000):
            raise InvalidArgument(
                "rows", "rows and cols must each be between 1 and 1000", (rows, cols)
            )
        await self._running(rec, pid).resize(rows, cols)

    async def send_stdin(self, rec: SandboxRecord, pid: int, data: bytes, eof: bool) -> None:
        """Input for a running command started with stdin_open."""
        try:
            await self._running(rec, pid).send_stdin(data, eof)
        except (ConnectionError, OSError) as exc:
            raise CommandNotFound(
                f"command {pid} in sandbox {rec.id} has ended", sandbox=rec.id, pid=pid
            ) from exc

    async def run_platform(
        self, rec: SandboxRecord, argv: builtins.list[str], stdin: bytes | None, doing: str
    ) -> bytes:
        """Run a platform tool (from /.corral) and return its stdout."""
        limit = self.config.max_file_bytes
        req = ExecRequest(cmd=argv, timeout=600, stdin=stdin, stdout_limit=limit)
        out: builtins.list[bytes] = []
        err: builtins.list[bytes] = []
        code, total = -1, 0
        async for ev in self.exec(rec, req):
            if isinstance(ev, ExecOutput):
                (out if ev.type == "stdout" else err).append(ev.data)
            elif isinstance(ev, ExecExit):
                code, total = ev.exit_code, ev.stdout_bytes
        if total > limit:
            raise InvalidArgument(
                "path", f"must hold at most {limit} bytes to download as a tar", f"<{total} bytes>"
            )
        if code != 0:
            raise FileError(f"{doing}: {b''.join(err).decode(errors='replace').strip()}")
        return b"".join(out)
