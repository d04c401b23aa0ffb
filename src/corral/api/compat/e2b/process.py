"""envd's `process.Process` service over Corral commands.

A started process is a Corral command whose events one task reads (a pump)
and hands to every stream attached to it: the Start stream, and any
Connect stream after it. The command outlives its streams, as envd's
processes outlive their clients; it ends with its own exit, its timeout
(the Start call's deadline), or a signal. The table of processes is this
server's: List shows the commands started through it, and SendInput,
CloseStdin and Connect reach those (a command's stdin is held by the node
that runs it, whichever server asks).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import posixpath
import signal as signals
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from corral.api.compat.e2b.connect import Abort, ConnectError
from corral.api.models import ExecExit, ExecOutput, ExecRequest, ExecStarted
from corral.api.models_base import MiB
from corral.api.service import SandboxService

ABORT: dict[str, Any] = {}  # the sandbox went away: streams drop, with no end event
# An event, ABORT, an error to end the stream with, or None: it is over.
Item = dict[str, Any] | ConnectError | None
# The client enforces its deadline itself; the command is stopped a little
# later, so that the client's own timeout is what it sees (as with envd).
DEADLINE_GRACE = 1.0

OUTPUT_LIMIT = 256 * MiB
MAX_TIMEOUT = 86400.0  # ExecRequest's longest timeout
# Events a stream may have waiting: past it the command's output waits
# (the pump, then the node, then the command's pipe), so a sandbox that
# floods output never grows this server's memory.
QUEUE = 256  # per stream: E2B has no cap, Corral's largest
SIGNALS = {"SIGNAL_SIGKILL": signals.SIGKILL, "SIGNAL_SIGTERM": signals.SIGTERM}


@dataclass
class Proc:
    sandbox: str
    pid: int
    config: dict[str, Any]
    tag: str | None
    pty: bool = False  # a terminal: its one output stream is envd's "pty"
    subscribers: set[asyncio.Queue[Item]] = field(default_factory=set)
    task: asyncio.Task[None] | None = None
    done: bool = False

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"config": self.config, "pid": self.pid}
        if self.tag is not None:
            out["tag"] = self.tag
        return out


def _event(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"event": {kind: body}}


def _end(x: ExecExit) -> dict[str, Any]:
    if x.signal:
        name = signals.Signals(x.signal).name.removeprefix("SIG").lower()
        body: dict[str, Any] = {"exitCode": -1, "exited": False, "status": f"signal: {name}"}
        if name == "kill":
            body["status"] = "signal: killed"
    else:
        body = {"exitCode": x.exit_code, "exited": True, "status": f"exit status {x.exit_code}"}
    if x.timed_out:
        body["error"] = "deadline exceeded"
    return _event("end", body)


class Processes:
    def __init__(self) -> None:
        self.table: dict[tuple[str, int], Proc] = {}

    def find(self, sandbox_id: str, selector: dict[str, Any]) -> Proc:
        pid, tag = selector.get("pid"), selector.get("tag")
        for p in self.table.values():
            if (
                p.sandbox == sandbox_id
                and not p.done
                and ((pid is not None and p.pid == int(pid)) or (tag is not None and p.tag == tag))
            ):
                return p
        raise ConnectError("not_found", f"process with {selector} not found")

    async def start(
        self,
        svc: SandboxService,
        sandbox_id: str,
        msg: dict[str, Any],
        *,
        user: str,
        home: str,
        deadline: float | None,
    ) -> tuple[Proc, asyncio.Queue[Item]]:
        """Start the command; the process and a queue of its events for the
        caller (the start event first)."""
        pty = _pty_size(msg.get("pty"))
        config = msg.get("process") or {}
        cmd = config.get("cmd")
        if not isinstance(cmd, str) or not cmd:
            raise ConnectError("invalid_argument", "process.cmd is required")
        args = config.get("args") or []
        envs = config.get("envs") or {}
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ConnectError("invalid_argument", "process.args must be strings")
        if not isinstance(envs, dict) or not all(isinstance(v, str) for v in envs.values()):
            raise ConnectError("invalid_argument", "process.envs must map strings to strings")
        try:
            req = ExecRequest(
                cmd=[cmd, *args], env=envs, user=user,
                cwd=posixpath.normpath(posixpath.join(home, config.get("cwd") or home)),
                # A deadline past Corral's longest command timeout (a client's
                # "unbounded", 24 h) is the client's alone to keep.
                timeout=deadline + DEADLINE_GRACE
                if deadline and deadline + DEADLINE_GRACE <= MAX_TIMEOUT else None,
                stdout_limit=OUTPUT_LIMIT, stderr_limit=OUTPUT_LIMIT,
                stdin_open=bool(msg.get("stdin", False)) or pty is not None, pty=pty,
            )  # fmt: skip
        except ValidationError as exc:
            bad = exc.errors()[0]
            where = ".".join(str(x) for x in bad["loc"])
            raise ConnectError("invalid_argument", f"{where}: {bad['msg']}") from None
        events = aiter(svc.exec(sandbox_id, req))
        first = await anext(events)
        if not isinstance(first, ExecStarted):
            raise ConnectError("internal", f"the command did not start: {first}")
        shown = {"cmd": cmd, "args": args, "envs": envs}
        if config.get("cwd"):
            shown["cwd"] = config["cwd"]
        proc = Proc(sandbox_id, first.pid, shown, msg.get("tag"), pty=pty is not None)
        queue: asyncio.Queue[Item] = asyncio.Queue(QUEUE)
        proc.subscribers.add(queue)
        queue.put_nowait(_event("start", {"pid": proc.pid}))
        self.table[(sandbox_id, proc.pid)] = proc
        proc.task = asyncio.create_task(self._pump(proc, events))
        return proc, queue

    async def _pump(self, proc: Proc, events: AsyncIterator[Any]) -> None:
        async def publish(m: Item) -> None:
            for q in list(proc.subscribers):
                await q.put(m)

        try:
            async for ev in events:
                if isinstance(ev, ExecOutput):
                    data = base64.b64encode(ev.data).decode()
                    await publish(_event("data", {"pty" if proc.pty else ev.type: data}))
                elif isinstance(ev, ExecExit) and ev.timed_out:
                    await publish(ConnectError("deadline_exceeded", "the call's deadline passed"))
                elif isinstance(ev, ExecExit):
                    await publish(_end(ev))
        except Exception:  # the sandbox went away under it (killed, lost)
            _offer(proc, ABORT)
        finally:
            proc.done = True
            _offer(proc, None)
            self.table.pop((proc.sandbox, proc.pid), None)

    def attach(self, proc: Proc) -> asyncio.Queue[Item]:
        queue: asyncio.Queue[Item] = asyncio.Queue(QUEUE)
        queue.put_nowait(_event("start", {"pid": proc.pid}))
        proc.subscribers.add(queue)
        return queue

    async def stream(
        self, proc: Proc, queue: asyncio.Queue[Item], keepalive: float | None
    ) -> AsyncIterator[dict[str, Any]]:
        """The events a stream shows, with keepalives when it is quiet."""
        try:
            while True:
                try:
                    async with asyncio.timeout(keepalive):
                        m = await queue.get()
                except TimeoutError:
                    yield _event("keepalive", {})
                    continue
                if m is None:
                    return
                if m is ABORT:
                    raise Abort(f"sandbox {proc.sandbox} is gone")
                if isinstance(m, ConnectError):
                    raise m
                yield m
        finally:
            proc.subscribers.discard(queue)
            while not queue.empty():  # a pump waiting to put here goes on
                queue.get_nowait()

    def abort(self, sandbox_id: str) -> None:
        """Its sandbox is being killed: drop every stream of its processes."""
        for p in [p for p in self.table.values() if p.sandbox == sandbox_id]:
            _offer(p, ABORT)
            if p.task is not None:
                p.task.cancel()

    def listed(self, sandbox_id: str) -> list[dict[str, Any]]:
        return [p.info() for p in self.table.values() if p.sandbox == sandbox_id and not p.done]

    async def close(self) -> None:
        tasks = [p.task for p in self.table.values() if p.task is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t


def _offer(proc: Proc, m: Item) -> None:
    """The last word to every stream, whatever they have waiting: it
    replaces what they have not read (they are over anyway)."""
    for q in list(proc.subscribers):
        while q.full():
            q.get_nowait()
        q.put_nowait(m)


def _pty_size(pty: object) -> tuple[int, int] | None:
    """(rows, cols) of envd's PTY message, or None for no terminal."""
    if not pty:
        return None
    size = pty.get("size") if isinstance(pty, dict) else None
    try:
        rows, cols = int((size or {}).get("rows", 24)), int((size or {}).get("cols", 80))
    except (TypeError, ValueError):
        raise ConnectError("invalid_argument", f"pty.size must be rows and cols: {pty!r}") from None
    if not (1 <= rows <= 1000 and 1 <= cols <= 1000):
        raise ConnectError("invalid_argument", f"pty size must be 1-1000 each: {rows}x{cols}")
    return rows, cols


def pty_size(msg: dict[str, Any]) -> tuple[int, int]:
    size = _pty_size(msg.get("pty"))
    if size is None:
        raise ConnectError("invalid_argument", "Update needs pty.size")
    return size


def signal_of(name: object) -> int:
    if name not in SIGNALS:
        raise ConnectError("invalid_argument", f"signal must be one of {sorted(SIGNALS)}: {name!r}")
    return SIGNALS[str(name)]


def decode_input(msg: dict[str, Any]) -> bytes:
    data = msg.get("input") or {}
    raw = data.get("stdin", data.get("pty", ""))
    try:
        return base64.b64decode(raw, validate=True)
    except (ValueError, TypeError):
        raise ConnectError("invalid_argument", "input must be base64") from None
