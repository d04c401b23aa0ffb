"""Run a helper process to its end from the event loop, waited on through
a pidfd.

asyncio's own subprocesses (3.11) are waited on by a thread per child
(ThreadedChildWatcher): starting it blocks the loop until the thread runs,
and its wake-ups contend for the GIL. A create and a close each spawn one
helper (corral-nsexec running crun), so at 16 creates in flight that was
a cost of every one of them (docs/warm-pool.md). Here the loop watches
the child's pidfd and its pipes like any other file descriptor.

Invariants: every child started here is reaped; a cancelled caller
returns only once its child has ended (killed at the timeout, if one was
given), so nothing a helper makes appears after its caller unwound; a
child's output is kept up to `LIMIT` bytes per stream (the tail), so a
chatty helper cannot grow the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

LIMIT = 1 << 20  # bytes kept of each stream


@dataclass(frozen=True)
class Finished:
    code: int
    stdout: bytes
    stderr: bytes


async def run(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    pass_fds: Sequence[int] = (),
    stdout: bool = False,
    timeout: float | None = None,
) -> Finished:
    """Run argv with stdin from /dev/null, stderr (and with `stdout`, its
    stdout) collected. With `timeout`, a child still running then is
    killed and TimeoutError raised once it is reaped."""
    loop = asyncio.get_running_loop()
    # Popen blocks only while the child is spawned, as asyncio's would.
    proc = subprocess.Popen(  # noqa: ASYNC220
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE if stdout else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        pass_fds=tuple(pass_fds),
        env=dict(env) if env is not None else None,
    )
    try:
        pidfd = os.pidfd_open(proc.pid)
    except OSError:  # cannot happen for our own unreaped child; never leak it
        proc.kill()
        proc.wait()
        raise
    exited: asyncio.Future[int] = loop.create_future()

    def reap() -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        code = proc.wait()  # exited: does not block
        if not exited.done():
            exited.set_result(code)

    loop.add_reader(pidfd, reap)
    streams = [_Stream(loop, p) for p in (proc.stdout, proc.stderr) if p is not None]
    deadline = None if timeout is None else loop.time() + timeout
    try:
        async with asyncio.timeout_at(deadline):
            code = await asyncio.shield(exited)
            for s in streams:
                await s.done
    except TimeoutError:
        await _kill(proc, exited)
        raise
    except asyncio.CancelledError:
        # A cancelled caller waits for its helper to end (up to the
        # timeout) before it unwinds: a helper left running goes on making
        # what its caller is about to clean up (a CRIU restore finished
        # after its create had been released: a process tree nobody owned).
        try:
            async with asyncio.timeout_at(deadline):
                await asyncio.shield(exited)
        except TimeoutError:
            await _kill(proc, exited)
        raise
    finally:
        for s in streams:
            s.close()
    err = streams[-1].data()
    return Finished(code=code, stdout=streams[0].data() if stdout else b"", stderr=err)


async def _kill(proc: subprocess.Popen[bytes], exited: asyncio.Future[int]) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    await asyncio.shield(exited)


class _Stream:
    """One pipe read to EOF by the loop, its tail kept."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pipe: IO[bytes]) -> None:
        self._loop = loop
        self._pipe = pipe
        self._fd = pipe.fileno()
        os.set_blocking(self._fd, False)
        self._chunks: list[bytes] = []
        self._size = 0
        self.done: asyncio.Future[None] = loop.create_future()
        loop.add_reader(self._fd, self._read)

    def _read(self) -> None:
        try:
            chunk = os.read(self._fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.close()
            return
        self._chunks.append(chunk)
        self._size += len(chunk)
        while self._size - len(self._chunks[0]) >= LIMIT:
            self._size -= len(self._chunks.pop(0))

    def data(self) -> bytes:
        return b"".join(self._chunks)[-LIMIT:]

    def close(self) -> None:
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            self._pipe.close()
            self._fd = -1
        if not self.done.done():
            self.done.set_result(None)
