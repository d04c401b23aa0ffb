"""Async client of a sandbox's exec server (corral-init) over its control socket.

One connection per request: requests never queue behind a long command, and
a broken connection costs only that request.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import errno as errno_mod
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from corral.errors import (
    FileError,
    FileNotFound,
    InvalidArgument,
    SandboxFailed,
    Unavailable,
)
from corral.execd import protocol as p

CHUNK = 256 * 1024
# A listing's entries and their bytes, at most: the host holds them all,
# and a sandbox makes the listing (100,000 hard links carrying 32 xattrs
# of 4 KiB each cost it ~20 MB of quota and the host ~13 GB). The server
# sends at most 100,000 (corral-init's LIST_MAX); 64 MiB is ~670 bytes an
# entry at that count, far past a name, a target and a few xattrs.
MAX_ENTRIES = 100_000
MAX_LIST_BYTES = 64 << 20
# The longest the host waits on the exec server for any one step of a
# request that is not a running command's output: an answer, the next
# frame of a file, room to send the next chunk. The server may be stuck
# or hostile (a VM guest's root owns its agent; a container's processes
# can stop a handler running as their uid); without a bound, a create,
# resume or fork that asks it something would wait for ever. A minute
# covers a first read through the lazy loader from a slow store.
REPLY_TIMEOUT = 60.0
# How long past a platform command's own timeout (enforced by the server)
# ExecdClient.run waits for its end.
RUN_GRACE = 10.0


def reply_refused(path: str, what: str) -> FileError:
    """An answer the host will not hold: the exec server sent `what`."""
    return FileError(
        f"{path}: the sandbox answered with {what}; refused",
        path=path,
        errno=errno_mod.EFBIG,
        strerror="EFBIG",
        refused="reply",
    )


@dataclass(frozen=True)
class Frame:
    kind: int
    payload: bytes


class Connection:
    """One framed stream to the exec server. Each wait on it is bounded by
    `reply_timeout` (Unavailable past it), but a command's output, which
    may rightly be silent for as long as the command runs."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        reply_timeout: float | None = None,
        where: str = "",
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.reply_timeout = REPLY_TIMEOUT if reply_timeout is None else reply_timeout
        self.where = where

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.drain()

    async def drain(self) -> None:
        async with self._bounded("took no more of the request"):
            await self.writer.drain()

    async def recv(self, *, bounded: bool = True) -> Frame:
        if not bounded:
            return await self._recv()
        async with self._bounded("gave no answer"):
            return await self._recv()

    @contextlib.asynccontextmanager
    async def _bounded(self, what: str) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(self.reply_timeout):
                yield
        except TimeoutError:
            raise Unavailable(
                f"sandbox exec server{self.where} {what} in {self.reply_timeout:g} s"
            ) from None

    async def _recv(self) -> Frame:
        try:
            head = await self.reader.readexactly(p.HEADER.size)
            length, _stream, kind = p.HEADER.unpack(head)
            if length > p.MAX_PAYLOAD:
                # The server may be hostile (a VM guest's root speaks for
                # its agent): a frame is never buffered past the protocol's cap.
                raise ConnectionError(f"exec server sent a {length}-byte frame")
            payload = await self.reader.readexactly(length) if length else b""
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            raise ConnectionError("exec server closed the connection") from exc
        return Frame(kind, payload)

    def close(self) -> None:
        self.writer.close()


def _parked(f: Frame) -> bool:
    """The server's word that it parked with this request unread (proto.h ERR_PARKED)."""
    if f.kind != p.RSP_ERROR or len(f.payload) < 8:
        return False
    return p.parse_error(f.payload).stage == p.ERR_PARKED


def raise_remote(err: p.RemoteError, path: str | None = None) -> None:
    """Turn an exec server error into the SDK's exception for it."""
    if err.stage == p.ERR_USER:
        raise InvalidArgument("user", "must be a user that exists in the sandbox", err.message)
    if err.stage == p.ERR_CWD:
        raise InvalidArgument(
            "cwd", "must be an existing directory the user may enter", err.message
        )
    if err.stage == p.ERR_EXEC:
        raise InvalidArgument("cmd", "must name a program that can run in the sandbox", err.message)
    if err.errno == errno_mod.ENOENT:
        raise FileNotFound(err.message, path=path)
    raise FileError(
        err.message, path=path, errno=err.errno, strerror=errno_mod.errorcode.get(err.errno, "?")
    )


class ExecdClient:
    def __init__(
        self,
        socket_path: str,
        connect_timeout: float = 10.0,
        settle: Callable[[], Awaitable[bool]] | None = None,
        reply_timeout: float | None = None,
    ) -> None:
        """`settle`, on a refused connection: wait for a change of the
        sandbox in flight, if one is (a fork's save parks the server, its
        listener closed), and say whether there was one: then the
        connection is tried again. `reply_timeout`: Connection's bound
        (REPLY_TIMEOUT, read when a connection is made)."""
        self.socket_path = socket_path
        self.connect_timeout = connect_timeout
        self.settle = settle
        self.reply_timeout = reply_timeout

    async def connect(self) -> Connection:
        for _ in range(3):  # each retry after a change that had ended
            try:
                async with asyncio.timeout(self.connect_timeout):
                    reader, writer = await asyncio.open_unix_connection(
                        self.socket_path, limit=4 * p.MAX_PAYLOAD
                    )
                return Connection(reader, writer, self.reply_timeout, f" at {self.socket_path}")
            except (TimeoutError, OSError) as exc:
                if self.settle is not None and await self.settle():
                    continue
                raise Unavailable(
                    f"sandbox exec server at {self.socket_path} is not reachable: {exc}"
                ) from exc
        raise Unavailable(
            f"sandbox exec server at {self.socket_path} was parked again and again: try again"
        )

    async def _exchange(
        self, send: Callable[[Connection], Awaitable[None]]
    ) -> tuple[Connection, Frame]:
        """Connect, send a request (`send` writes it) and read its first
        answer. A request that a change of the sandbox left unanswered is
        sent again on a new connection once that change has ended: one
        queued when a save parked the server (ERR_PARKED, or a reset: a
        peer whose bytes were not all read is reset before it can read).
        Safe because a change cuts no handler off (a save waits for them
        before it freezes): a connection that ends unanswered while a change
        is in flight ran nothing."""
        for _ in range(3):  # each retry after a change that had ended
            conn = await self.connect()
            try:
                # A reset while sending: the answer may have come all the
                # same (a command that exited without reading all its
                # input, tar refusing a bad archive, as a pipe's reader
                # going away; or a parked server's ERR_PARKED).
                with contextlib.suppress(ConnectionError):
                    await send(conn)
                first = await conn.recv()
            except ConnectionError:
                conn.close()
                if self.settle is not None and await self.settle():
                    continue
                raise
            except BaseException:
                conn.close()
                raise
            if not _parked(first):
                return conn, first
            conn.close()
            if self.settle is None or not await self.settle():
                raise Unavailable(f"sandbox exec server at {self.socket_path} is parked: try again")
        raise Unavailable(
            f"sandbox exec server at {self.socket_path} was parked again and again: try again"
        )

    async def ping(self) -> tuple[int, int]:
        conn, f = await self._exchange(lambda c: c.send(p.frame(p.REQ_PING)))
        try:
            if f.kind != p.RSP_PONG:
                raise SandboxFailed(f"unexpected answer 0x{f.kind:x} to ping")
            version, pid = struct.unpack("<II", f.payload[:8])
            return version, pid
        finally:
            conn.close()

    async def _until_ok(self, request: bytes, path: str) -> AsyncIterator[Frame]:
        """Send one request and yield its frames up to OK; ERROR raises."""
        conn, f = await self._exchange(lambda c: c.send(request))
        try:
            while True:
                if f.kind == p.RSP_ERROR:
                    raise_remote(p.parse_error(f.payload), path)
                if f.kind == p.RSP_OK:
                    return
                yield f
                f = await conn.recv()
        finally:
            conn.close()

    async def read(self, user: str, path: str, max_bytes: int, *, nofollow: bool = False) -> bytes:
        flags = p.FILE_NOFOLLOW if nofollow else 0
        request = p.file_request(p.REQ_READ, user, path, p.u64(max_bytes) + p.u32(flags))
        parts, total = [], 0
        async for f in self._until_ok(request, path):
            total += len(f.payload)
            if total > max_bytes:
                raise reply_refused(path, f"more than the {max_bytes} bytes asked for")
            parts.append(f.payload)
        return b"".join(parts)

    async def write(
        self,
        user: str,
        path: str,
        data: bytes,
        *,
        mode: int = 0o644,
        mkdirs: bool = True,
        append: bool = False,
        max_bytes: int,
        nofollow: bool = False,
    ) -> int:
        flags = (p.FILE_MKDIRS if mkdirs else 0) | (p.FILE_APPEND if append else 0)
        flags |= p.FILE_NOFOLLOW if nofollow else 0
        head = p.file_request(
            p.REQ_WRITE, user, path, p.u32(mode) + p.u32(flags) + p.u64(max_bytes)
        )

        async def send(conn: Connection) -> None:
            conn.writer.write(head)
            view = memoryview(data)
            for off in range(0, len(view), CHUNK):
                conn.writer.write(p.frame(p.REQ_DATA, bytes(view[off : off + CHUNK])))
                await conn.drain()
            await conn.send(p.frame(p.REQ_END))

        conn, f = await self._exchange(send)
        try:
            if f.kind == p.RSP_ERROR:
                raise_remote(p.parse_error(f.payload), path)
            return int(struct.unpack("<Q", f.payload[:8])[0])
        finally:
            conn.close()

    async def list(self, user: str, path: str) -> builtins.list[p.Entry]:
        request = p.file_request(p.REQ_LIST, user, path)
        entries: builtins.list[p.Entry] = []
        size = 0
        async for f in self._until_ok(request, path):
            size += len(f.payload)
            if len(entries) >= MAX_ENTRIES:
                raise reply_refused(path, f"more than {MAX_ENTRIES} directory entries")
            if size > MAX_LIST_BYTES:
                raise reply_refused(path, f"a listing of more than {MAX_LIST_BYTES} bytes")
            entries.append(p.parse_entry(f.payload, f.kind))
        return entries

    async def stat(self, user: str, path: str) -> p.Entry:
        conn, f = await self._exchange(lambda c: c.send(p.file_request(p.REQ_STAT, user, path)))
        try:
            if f.kind == p.RSP_ERROR:
                raise_remote(p.parse_error(f.payload), path)
            return p.parse_entry(f.payload, f.kind)
        finally:
            conn.close()

    async def _ok(self, request: bytes, path: str | None) -> None:
        conn, f = await self._exchange(lambda c: c.send(request))
        try:
            if f.kind == p.RSP_ERROR:
                raise_remote(p.parse_error(f.payload), path)
        finally:
            conn.close()

    async def mkdir(self, user: str, path: str, *, parents: bool = True, mode: int = 0o755) -> None:
        flags = p.FILE_MKDIRS if parents else 0
        await self._ok(p.file_request(p.REQ_MKDIR, user, path, p.u32(mode) + p.u32(flags)), path)

    async def remove(self, user: str, path: str, *, recursive: bool = True) -> None:
        flags = p.FILE_RECURSIVE if recursive else 0
        await self._ok(p.file_request(p.REQ_REMOVE, user, path, p.u32(flags)), path)

    async def kill(self, pid: int, signal: int) -> None:
        await self._ok(p.frame(p.REQ_KILL, p.u32(pid) + p.u32(signal)), None)

    async def park(self, nonce: str) -> None:
        """Ask PID 1 to park its listener before a checkpoint (proto.h
        REQ_PARK). A request that reached a handler instead (it was not
        whole when PID 1 looked) is answered EAGAIN and sent again."""
        pause = 0.002
        for _ in range(60):
            conn = await self.connect()
            try:
                await conn.send(p.frame(p.REQ_PARK, nonce.encode()))
                f = await conn.recv()
                if f.kind == p.RSP_OK:
                    # PID 1 closes its end once its listener is parked:
                    # until then the connection is a host socket in it.
                    with contextlib.suppress(ConnectionError):
                        while True:
                            await conn.recv()
                    return
                if f.kind != p.RSP_ERROR:
                    raise SandboxFailed(f"unexpected answer 0x{f.kind:x} to park")
                err = p.parse_error(f.payload)
                if err.errno != errno_mod.EAGAIN:
                    raise_remote(err, None)
            finally:
                conn.close()
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.1)
        raise SandboxFailed("the sandbox's init did not take the park request")

    async def set_xattrs(self, user: str, path: str, clear: str, values: dict[str, str]) -> None:
        """Remove the user.* attributes named `clear`..., then set `values`."""
        tail = p.string(clear) + p.u32(len(values))
        for k, v in values.items():
            tail += p.string(k) + p.string(v)
        await self._ok(p.file_request(p.REQ_XATTR, user, path, tail), path)

    async def reseed(self, entropy: bytes) -> None:
        """Credit `entropy` to the sandbox kernel's pool and re-key its
        CRNG (a VM's guest; in a container: PermissionDenied, the kernel
        being the host's)."""
        await self._ok(p.frame(p.REQ_RESEED, entropy), None)

    async def set_time(self, ns: int) -> None:
        """Set the sandbox kernel's wall clock to `ns` since the epoch (a
        VM's guest; in a container: PermissionDenied)."""
        await self._ok(p.frame(p.REQ_SETTIME, p.u64(ns)), None)

    async def reset(self, dirs: builtins.list[str]) -> None:
        """Kill every process but init, empty `dirs`, drop SysV IPC."""
        await self._ok(p.frame(p.REQ_RESET, p.strings(dirs)), None)

    async def start(
        self,
        argv: builtins.list[str],
        env: builtins.list[str],
        *,
        user: str,
        cwd: str,
        timeout: float | None,
        stdout_cap: int,
        stderr_cap: int,
        stdin: bytes | None,
        stdin_open: bool = False,
        pty: tuple[int, int] | None = None,
        idle: bool = False,
        stdin_timeout: float | None = None,
    ) -> ExecSession:
        """Start a command; the session yields its output and exit. With
        `stdin_open` its stdin stays open for ExecSession.send_stdin.
        `stdin_timeout` bounds the wait for the server to take `stdin`
        (it takes it as the command reads it: the command's timeout and a
        grace is the bound a caller gives); None: no bound."""
        request = p.exec_request(
            argv,
            env,
            user=user,
            cwd=cwd,
            timeout_ms=int(timeout * 1000) if timeout else 0,
            stdout_cap=stdout_cap,
            stderr_cap=stderr_cap,
            stdin_stream=stdin is not None or stdin_open,
            pty=pty,
            idle=idle,
        )

        async def send(conn: Connection) -> None:
            conn.writer.write(request)
            if stdin is not None or stdin_open:
                view = memoryview(stdin or b"")
                for off in range(0, len(view), CHUNK):
                    conn.writer.write(p.frame(p.REQ_STDIN, bytes(view[off : off + CHUNK])))
                if not stdin_open:
                    conn.writer.write(p.frame(p.REQ_STDIN_EOF))
            # Not REPLY_TIMEOUT: the server takes stdin as the command
            # reads it, which may rightly be late.
            try:
                async with asyncio.timeout(stdin_timeout):
                    await conn.writer.drain()
            except TimeoutError:
                raise Unavailable(
                    f"sandbox exec server at {self.socket_path} took no stdin "
                    f"in {stdin_timeout:g} s"
                ) from None

        conn, f = await self._exchange(send)
        try:
            if f.kind == p.RSP_ERROR:
                raise_remote(p.parse_error(f.payload))
            if f.kind != p.RSP_STARTED:
                raise SandboxFailed(f"unexpected answer 0x{f.kind:x} to exec")
            pid = int(struct.unpack("<I", f.payload[:4])[0])
        except BaseException:
            conn.close()
            raise
        return ExecSession(conn, pid)

    async def run(
        self,
        argv: builtins.list[str],
        *,
        user: str,
        timeout: float,
        env: builtins.list[str] | None = None,
        cap: int = 1 << 16,
    ) -> tuple[int, bytes, bytes]:
        """A platform command to its end: (exit code, stdout, stderr), each
        stream kept to its first `cap` bytes, here as well as by the server:
        a VM guest's root speaks for its agent and may send more. For the
        node's own short commands; a user's go through sessions
        (node/sessions.py)."""
        session = await self.start(
            argv, env or [], user=user, cwd="/", timeout=timeout, stdout_cap=cap,
            stderr_cap=cap, stdin=None,
        )  # fmt: skip
        out, err, code = bytearray(), bytearray(), -1
        try:
            async with asyncio.timeout(timeout + RUN_GRACE):
                async for kind, data in session.events():
                    if kind == p.RSP_STDOUT:
                        out += data[: cap - len(out)]
                    elif kind == p.RSP_STDERR:
                        err += data[: cap - len(err)]
                    else:
                        code = p.parse_exit(data).exit_code
        except TimeoutError:
            raise Unavailable(
                f"sandbox exec server at {self.socket_path} did not end {argv[0]} "
                f"{RUN_GRACE:g} s after its {timeout:g} s timeout"
            ) from None
        finally:
            session.close()
        return code, bytes(out), bytes(err)


class ExecSession:
    """A running command: its pid, its output events, and a way to signal it."""

    def __init__(self, conn: Connection, pid: int) -> None:
        self.conn = conn
        self.pid = pid

    async def events(self) -> AsyncIterator[tuple[int, bytes]]:
        """Yields (RSP_STDOUT|RSP_STDERR, data) and finally (RSP_EXIT, payload)."""
        try:
            while True:
                # A command may be silent for as long as it runs: the
                # caller bounds it (its timeout, plus a grace).
                f = await self.conn.recv(bounded=False)
                if f.kind in (p.RSP_STDOUT, p.RSP_STDERR):
                    yield f.kind, f.payload
                elif f.kind == p.RSP_EXIT:
                    yield f.kind, f.payload
                    return
        finally:
            self.conn.close()

    async def signal(self, signo: int) -> None:
        await self.conn.send(p.frame(p.REQ_SIGNAL, p.u32(signo)))

    async def resize(self, rows: int, cols: int) -> None:
        """A terminal command's new size (its programs get SIGWINCH)."""
        await self.conn.send(p.frame(p.REQ_RESIZE, p.u32(rows) + p.u32(cols)))

    async def send_stdin(self, data: bytes, eof: bool = False) -> None:
        """More input for a command started with stdin_open (then EOF)."""
        view = memoryview(data)
        for off in range(0, len(view), CHUNK):
            self.conn.writer.write(p.frame(p.REQ_STDIN, bytes(view[off : off + CHUNK])))
        if eof:
            self.conn.writer.write(p.frame(p.REQ_STDIN_EOF))
        await self.conn.writer.drain()

    def close(self) -> None:
        self.conn.close()
