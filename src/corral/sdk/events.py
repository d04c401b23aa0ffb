"""client.events(): what happens to sandboxes, as it happens.

    stream = await client.events(labels={"job": "7"})
    async for event in stream:           # or: event = await stream.next(timeout=5)
        if event.kind == "finding" and event.finding.severity == "violation":
            drop(event.sandbox)
    await stream.close()

The stream is live when events() returns (the service said `subscribed`):
nothing that happens after is missed, unless the reader falls so far behind
that the node drops events for it, which it says with a `lost` event. One
task reads the service's stream (an HTTP stream must be read by the task
that opened it), so next() may be called from any task, and the blocking
twin works the same.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from corral.api.models import Event
from corral.api.service import SandboxService
from corral.errors import CorralError, InternalError, Unavailable

_END = object()


class AsyncEventStream:
    def __init__(self, service: SandboxService, labels: dict[str, str] | None) -> None:
        self._queue: asyncio.Queue[Event | BaseException | object] = asyncio.Queue()
        self._live = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._pump(service, labels))

    async def _pump(self, service: SandboxService, labels: dict[str, str] | None) -> None:
        try:
            async for event in service.events(labels):
                if event.kind == "subscribed":
                    if not self._live.done():
                        self._live.set_result(None)
                    continue
                self._queue.put_nowait(event)
            self._queue.put_nowait(_END)
        except Exception as exc:
            err = exc if isinstance(exc, CorralError) else InternalError(f"event stream: {exc}")
            if not self._live.done():
                self._live.set_exception(err)
            self._queue.put_nowait(err)
        finally:
            if not self._live.done():
                self._live.set_exception(Unavailable("the event stream ended before it began"))

    async def _opened(self) -> AsyncEventStream:
        await self._live
        return self

    async def next(self, timeout: float | None = None) -> Event | None:
        """The next event; None if `timeout` seconds pass without one, or
        once the stream has ended (the server went away: open another)."""
        try:
            async with asyncio.timeout(timeout):
                item = await self._queue.get()
        except TimeoutError:
            return None
        if item is _END:
            self._queue.put_nowait(_END)
            return None
        if isinstance(item, BaseException):
            raise item
        assert isinstance(item, Event)
        return item

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task

    async def __aiter__(self) -> AsyncIterator[Event]:
        while (event := await self.next()) is not None:
            yield event


async def open_stream(service: SandboxService, labels: dict[str, str] | None) -> AsyncEventStream:
    stream = AsyncEventStream(service, labels)
    try:
        return await stream._opened()
    except BaseException:
        await stream.close()
        raise
