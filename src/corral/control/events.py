"""A project's event stream through a gateway: its live nodes' streams,
merged, each filtered on the node by the project's label (so no node
sends another project's events here).

The merged stream says `subscribed` once every node's stream has (a node
that cannot be reached is logged and left out: its sandboxes' events are
missed, not the others'). Each node's stream is read by its own task
(httpx's stream must open and close in the task that reads it).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping

from corral.api.models import Event
from corral.api.service import SandboxService
from corral.log import get_logger

log = get_logger("corral.gateway")


async def merged(
    streams: Mapping[str, SandboxService], labels: dict[str, str]
) -> AsyncIterator[Event]:
    """`labels`' events from every node of `streams` (name: its client)."""
    queue: asyncio.Queue[Event] = asyncio.Queue(maxsize=1024)
    ready: asyncio.Queue[str] = asyncio.Queue()

    async def pump(name: str, node: SandboxService) -> None:
        try:
            async for event in node.events(labels):
                if event.kind == "subscribed":
                    ready.put_nowait(name)
                    continue
                with contextlib.suppress(asyncio.QueueFull):
                    queue.put_nowait(event)  # a slow reader loses events, not the node
        except Exception as exc:
            log.warning("events.node_failed", node=name, error=str(exc))
        finally:
            ready.put_nowait(name)  # a node that failed does not hold the start up

    tasks = [asyncio.create_task(pump(n, s)) for n, s in streams.items()]
    try:
        waiting = set(streams)
        while waiting:
            waiting.discard(await ready.get())
        yield Event(kind="subscribed", at=time.time(), labels=labels)
        while True:
            yield await queue.get()
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
