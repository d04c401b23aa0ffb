"""A project's event stream through a gateway: its live nodes' streams,
merged, each filtered on the node by the project's label (so no node
sends another project's events here).

The merged stream says `subscribed` once every node's stream has, or after
SUBSCRIBE_TIMEOUT (a node that cannot be reached, or does not answer, is
logged and left out until it does: its sandboxes' events are missed, not
the others'). Each node's stream is read by its own task
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

SUBSCRIBE_TIMEOUT = 10.0  # a node's "subscribed", at most, before the stream starts


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
        try:
            # A node that takes the stream and says nothing (stuck, or
            # half-open) must not keep every subscriber from starting: past
            # the bound the stream starts without it, its events joining
            # whenever it does.
            async with asyncio.timeout(SUBSCRIBE_TIMEOUT):
                while waiting:
                    waiting.discard(await ready.get())
        except TimeoutError:
            log.warning("events.nodes_late", nodes=sorted(waiting), after_s=SUBSCRIBE_TIMEOUT)
        yield Event(kind="subscribed", at=time.time(), labels=labels)
        while True:
            yield await queue.get()
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
