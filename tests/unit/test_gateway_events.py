"""The gateway's merged event stream: it starts once every node's stream
has said `subscribed`, or after a bound when one never does (a stuck or
half-open node must not hold every subscriber), and that node's events
still join once it speaks."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest

from corral.api.models import Event
from corral.api.service import SandboxService
from corral.control import events


class _Node:
    """A node's events() as the gateway reads it: `subscribed` after
    `delay` seconds (None: never), then the events put in `later`."""

    def __init__(self, delay: float | None) -> None:
        self.delay = delay
        self.later: asyncio.Queue[Event] = asyncio.Queue()

    async def events(self, labels: dict[str, str] | None = None) -> AsyncIterator[Event]:
        if self.delay is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(self.delay or 0)
        yield Event(kind="subscribed", at=time.time())
        while True:
            yield await self.later.get()


def _streams(**nodes: _Node) -> dict[str, SandboxService]:
    return cast(dict[str, SandboxService], nodes)


async def _first(stream: AsyncIterator[Event], timeout: float) -> Event:
    async with asyncio.timeout(timeout):
        return await anext(stream)


async def test_the_stream_starts_when_every_node_has_subscribed() -> None:
    a, b = _Node(0.0), _Node(0.2)
    stream = events.merged(_streams(a=a, b=b), {})
    began = time.monotonic()
    assert (await _first(stream, 5)).kind == "subscribed"
    assert time.monotonic() - began >= 0.2  # it waited for the slower node
    await b.later.put(Event(kind="state", at=time.time(), sandbox="s1", state="running"))
    assert (await _first(stream, 5)).sandbox == "s1"
    await cast(Any, stream).aclose()


async def test_a_node_that_never_subscribes_holds_the_stream_only_up_to_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(events, "SUBSCRIBE_TIMEOUT", 0.3)
    live, silent = _Node(0.0), _Node(None)
    stream = events.merged(_streams(live=live, silent=silent), {})
    assert (await _first(stream, 5)).kind == "subscribed"
    await live.later.put(Event(kind="state", at=time.time(), sandbox="s2", state="running"))
    assert (await _first(stream, 5)).sandbox == "s2"
    await cast(Any, stream).aclose()
