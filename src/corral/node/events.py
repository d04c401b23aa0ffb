"""The node's event stream: state changes, command ends and findings, to
whoever subscribed (client.events(), the dashboard), filtered by labels.

Publishing never waits and costs nothing without subscribers: each
subscriber has a bounded queue, and one that falls behind loses events
(it is told how many, in a `lost` event) rather than slowing the node or
growing its memory. Events are not stored: the report and the command
log are the record; the stream is for reacting now.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from corral.api.models import Event
from corral.labels import without_secrets

QUEUE = 1024  # events a subscriber may fall behind by before it loses some


class _Subscriber:
    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.queue: asyncio.Queue[Event] = asyncio.Queue(QUEUE)
        self.lost = 0


class EventBus:
    def __init__(self, labels_of: Callable[[str], dict[str, str]]) -> None:
        self._labels_of = labels_of  # a sandbox's labels (the store's)
        self._subs: set[_Subscriber] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Labels never change after a create: looked up once a sandbox.
        self._labels: dict[str, dict[str, str]] = {}

    @property
    def active(self) -> bool:
        return bool(self._subs)

    def publish(self, kind: str, sandbox: str, **fields: Any) -> None:
        """Send an event to the subscribers whose labels it matches. Safe
        from any thread (the store's transitions may run in one)."""
        if not self._subs:
            return
        loop = self._loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        labels = self._labels.get(sandbox) if sandbox else {}
        if labels is None:
            # A subscriber sees a sandbox's labels, never its secrets (a
            # stream outlives the key that opened it by up to keys.RECHECK).
            labels = self._labels[sandbox] = without_secrets(self._labels_of(sandbox))
        if fields.get("state") in ("closed", "failed"):
            self._labels.pop(sandbox, None)
        event = Event(kind=kind, at=time.time(), sandbox=sandbox, labels=labels, **fields)  # type: ignore[arg-type]
        if loop is not None and running is not loop:
            loop.call_soon_threadsafe(self._deliver, event)
        else:
            self._deliver(event)

    def _deliver(self, event: Event) -> None:
        for sub in list(self._subs):
            if any(event.labels.get(k) != v for k, v in sub.labels.items()):
                continue
            try:
                sub.queue.put_nowait(event)
            except asyncio.QueueFull:
                sub.lost += 1

    def subscribe(self, labels: dict[str, str] | None) -> AsyncIterator[Event]:
        """Events from now on (the subscription holds from this call, not
        from the first read), until the caller stops iterating. The first
        event is `subscribed`: a caller that waits for it knows nothing
        after is missed."""
        self._loop = asyncio.get_running_loop()
        sub = _Subscriber(dict(labels or {}))
        self._subs.add(sub)
        return self._stream(sub)

    async def _stream(self, sub: _Subscriber) -> AsyncIterator[Event]:
        try:
            yield Event(kind="subscribed", at=time.time(), labels=sub.labels)
            while True:
                event = await sub.queue.get()
                if sub.lost:
                    lost, sub.lost = sub.lost, 0
                    yield Event(kind="lost", at=time.time(), lost=lost)
                yield event
        finally:
            self._subs.discard(sub)
