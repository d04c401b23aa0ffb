"""Commands that run at most once per key: a rollout's steps.

A command sent with a key (ExecRequest.key) is recorded in the node's store
*before* it starts, and its events (output within its caps, its exit) when
it ends. The same key again gets the recorded events back instead of a
second run; while the first run is in flight, the second waits for it. The
run belongs to the node, not to the caller's connection: a caller that
dies (a preempted trainer) leaves it to finish and be recorded.

The one case nobody can settle is a key recorded as started whose run was
lost with the agent that ran it (an embedded trainer killed with its
node): its effects may or may not have happened, and it is reported as
Ambiguous, never run again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import TypeAdapter

from corral import metrics
from corral.api.models import ExecEvent, ExecRequest
from corral.errors import Ambiguous, CorralError, InvalidArgument, error_from_wire
from corral.node.store import SandboxRecord, Store

_EVENTS: TypeAdapter[list[ExecEvent]] = TypeAdapter(list[ExecEvent])
# A keyed command's output is kept in the node's store for its replays (and
# carried by a save): its caps, stdout and stderr together, at most this.
# The sandbox fills whatever caps the caller gave, and the store is the
# node's, shared by every project on it.
RECORDED_MAX = 32 << 20

Run = Callable[[SandboxRecord, ExecRequest], AsyncIterator[ExecEvent]]


def digest(req: ExecRequest) -> str:
    """What makes two requests the same command (all but the key)."""
    body = req.model_dump(mode="json", exclude={"key"})
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class _Run:
    """One keyed command in flight: its events so far, for any follower."""

    def __init__(self) -> None:
        self.events: list[ExecEvent] = []
        self.error: CorralError | None = None
        self.done = False
        self.changed = asyncio.Condition()

    async def add(self, event: ExecEvent | None, error: CorralError | None = None) -> None:
        async with self.changed:
            if event is not None:
                self.events.append(event)
            if error is not None or event is None:
                self.error, self.done = error, True
            self.changed.notify_all()

    async def follow(self) -> AsyncIterator[ExecEvent]:
        i = 0
        while True:
            async with self.changed:
                while not self.done and len(self.events) <= i:
                    await self.changed.wait()
                batch, done, error = self.events[i:], self.done, self.error
            for event in batch:
                yield event
            i += len(batch)
            if done:
                if error is not None:
                    raise error
                return


class KeyedExecs:
    def __init__(self, store: Store, run: Run) -> None:
        self.store = store
        self._run = run
        self._inflight: dict[tuple[str, str], _Run] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def exec(self, rec: SandboxRecord, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        assert req.key is not None
        if req.background:
            raise InvalidArgument(
                "key", "is for commands run to completion, not background", req.key
            )
        if req.stdout_limit + req.stderr_limit > RECORDED_MAX:
            raise InvalidArgument(
                "stdout_limit",
                f"with a key, stdout_limit + stderr_limit must be at most {RECORDED_MAX} bytes "
                "(a keyed command's output is recorded for its replays)",
                req.stdout_limit + req.stderr_limit,
            )
        sid, key, want = rec.id, req.key, digest(req)
        run = self._inflight.get((sid, key))
        if run is None:
            row = self.store.exec_key(sid, key)
            if row is not None:
                outcome = "replayed" if row[1] is not None else "ambiguous"
                metrics.KEYED_EXECS.labels(outcome).inc()
                async for event in self._replay(sid, key, want, row):
                    yield event
                return
            metrics.KEYED_EXECS.labels("run").inc()
            # Recorded before it starts: after any crash, a key the store
            # lacks never ran.
            self.store.exec_key_start(sid, key, want)
            run = _Run()
            self._inflight[(sid, key)] = run
            task = asyncio.create_task(self._drive(rec, req, run), name=f"keyed-{sid}-{key}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        elif self.store.exec_key(sid, key)[0] != want:  # type: ignore[index]
            raise self._mismatch(key)
        else:
            metrics.KEYED_EXECS.labels("joined").inc()
        async for event in run.follow():
            yield event

    async def _drive(self, rec: SandboxRecord, req: ExecRequest, run: _Run) -> None:
        """Run the command to its end whoever listens, and record it."""
        key = req.key or ""
        error: CorralError | None = None
        try:
            async for event in self._run(rec, req):
                await run.add(event)
        except CorralError as exc:
            error = exc
        except Exception as exc:  # recorded like the rest: the key is spent
            error = CorralError(f"command failed: {exc}")
        finally:
            result: dict[str, Any] = {"events": _EVENTS.dump_python(run.events, mode="json")}
            if error is not None:
                result["error"] = error.to_wire()
            self.store.exec_key_end(rec.id, key, json.dumps(result))
            self._inflight.pop((rec.id, key), None)
            await run.add(None, error)

    async def _replay(
        self, sid: str, key: str, want: str, row: tuple[str, str | None]
    ) -> AsyncIterator[ExecEvent]:
        got, result = row
        if got != want:
            raise self._mismatch(key)
        if result is None:
            raise Ambiguous(
                f"the command with key {key!r} in sandbox {sid} started, but the agent that "
                "ran it stopped before it ended: it may or may not have had its effects, and "
                "is not run again",
                sandbox=sid,
                key=key,
            )
        doc = json.loads(result)
        for event in _EVENTS.validate_python(doc["events"]):
            yield event
        if "error" in doc:
            raise error_from_wire(doc["error"])

    @staticmethod
    def _mismatch(key: str) -> InvalidArgument:
        return InvalidArgument(
            "key", "was already used for a different command in this sandbox", key
        )

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
