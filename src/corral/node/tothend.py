"""State changes of a sandbox that, once begun, run to their end.

A suspend, a resume or a release moves a sandbox through the kernel (CRIU
dumps and restores, cgroups, mounts, processes) while its record says
"suspending", "resuming" or "closing". A caller's cancel (a trainer's
step timing out, a client going away) must not stop one half-way: each
had left a sandbox whose kernel state and record disagreed (processes
ended under "running", a restored tree under "suspended", cgroups, disk
and processes held under "closing" that a second close found nothing to
do about). So the change runs as a task of its own; the caller awaits it
through a shield and, cancelled, only stops waiting. A second caller for
the same sandbox waits for the change in flight.

Invariant: at most one change per sandbox runs at a time in this process.
The record's state machine lets only one suspend, resume or close win its
transition, but a fork's save leaves the record "running": a second fork,
or a suspend, asked while it runs is started once it ends (two CRIU dumps
of one tree, or a freeze under a dump, had hung or thawed a sandbox
recorded as frozen). So a change never asks for another change of its own
sandbox from the same ToTheEnd: it would wait for itself."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any, TypeVar

from corral.log import get_logger

T = TypeVar("T")
log = get_logger("corral.node")

# The sandboxes whose change this task runs in (inherited by the tasks it
# starts): wait() from inside a change does not wait for itself.
_IN_CHANGE: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "in_change", default=frozenset()
)


class ToTheEnd:
    def __init__(self) -> None:
        self._running: dict[str, asyncio.Task[Any]] = {}

    async def run(self, sandbox_id: str, change: Coroutine[Any, Any, T]) -> T:
        """Start `change` for `sandbox_id` (after the one in flight, if
        any) and wait for it."""
        return await asyncio.shield(self._start(sandbox_id, change))

    async def wait(self, sandbox_id: str) -> bool:
        """Wait for the change in flight for `sandbox_id`, if one is (its
        error is its own caller's); whether there was one. Called from
        within that change (a step that reaches the sandbox's exec
        server), it does not wait: there is none other."""
        task = self._running.get(sandbox_id)
        if task is None or sandbox_id in _IN_CHANGE.get():
            return False
        await asyncio.shield(asyncio.gather(task, return_exceptions=True))
        return True

    def busy(self, sandbox_id: str) -> bool:
        """Whether a change of `sandbox_id` is in flight in this process."""
        return sandbox_id in self._running

    async def aclose(self) -> None:
        """Let every change in flight end."""
        await asyncio.gather(*self._running.values(), return_exceptions=True)

    async def finish(self, sandbox_id: str, change: Coroutine[Any, Any, T]) -> T:
        """Like run(), but a cancelled caller waits for the change to end
        before its CancelledError: for a change whose caller cleans up
        after it (a fork's source saved to a file the fork then removes)."""
        task = self._start(sandbox_id, change)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            await asyncio.shield(asyncio.gather(task, return_exceptions=True))
            raise

    def _start(self, sandbox_id: str, change: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """The change's task, registered before this returns (no await
        between a caller's check of the record and the registration)."""
        before = self._running.get(sandbox_id)

        async def in_turn() -> T:
            if before is not None:
                try:
                    await asyncio.gather(before, return_exceptions=True)
                except BaseException:
                    change.close()  # never started: nothing of it to undo
                    raise
            _IN_CHANGE.set(_IN_CHANGE.get() | {sandbox_id})
            return await change

        task = asyncio.create_task(in_turn())
        self._running[sandbox_id] = task
        task.add_done_callback(lambda t: self._forget(sandbox_id, t))
        return task

    def _forget(self, sandbox_id: str, task: asyncio.Task[Any]) -> None:
        if self._running.get(sandbox_id) is task:
            del self._running[sandbox_id]
        # Its caller may have stopped waiting: the failure is said here too
        # (and taken, so asyncio does not call it unretrieved).
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            log.warning("sandbox.change_failed", sandbox=sandbox_id, error=str(exc) or repr(exc))
