"""A client starts its service once, however many first calls arrive at
the same time (a trainer's environments all resetting at once), and its
close stops what was started, even a start still under way. Found by the
README's demo: its 32 gymnasium episodes started an embedded node 32 times
and closed one, so the node's shared parts (the run tmpfs, the seccomp
daemon) outlived the job."""

from __future__ import annotations

import asyncio

import pytest

import corral

from .test_http_api import FakeService


class SlowStart(FakeService):
    def __init__(self, fail: int = 0) -> None:
        super().__init__()
        self.fail = fail  # the first `fail` starts raise
        self.closes = 0

    async def start(self) -> None:
        self.starts += 1
        await asyncio.sleep(0.05)  # long enough for every caller to arrive
        if self.starts <= self.fail:
            raise corral.Unavailable("not yet")

    async def aclose(self) -> None:
        self.closes += 1


async def test_concurrent_first_calls_start_the_service_once() -> None:
    svc = SlowStart()
    client = corral.AsyncClient(transport=svc)
    await asyncio.gather(*(client.sandboxes.list() for _ in range(32)))
    assert svc.starts == 1
    await client.aclose()
    assert svc.closes == 1
    await client.aclose()
    assert svc.closes == 1


async def test_a_failed_start_fails_every_waiter_and_the_next_call_tries_again() -> None:
    svc = SlowStart(fail=1)
    client = corral.AsyncClient(transport=svc)
    got = await asyncio.gather(*(client.sandboxes.list() for _ in range(4)), return_exceptions=True)
    assert all(isinstance(g, corral.Unavailable) for g in got)
    assert svc.starts == 1
    assert await client.sandboxes.list() == []
    assert svc.starts == 2
    await client.aclose()
    assert svc.closes == 1


async def test_a_waiter_cancelled_leaves_the_start_to_the_others() -> None:
    svc = SlowStart()
    client = corral.AsyncClient(transport=svc)
    first = asyncio.ensure_future(client.sandboxes.list())
    await asyncio.sleep(0.01)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await client.sandboxes.list() == []
    assert svc.starts == 1
    await client.aclose()
    assert svc.closes == 1


async def test_close_during_a_start_waits_for_it_and_closes_it() -> None:
    svc = SlowStart()
    client = corral.AsyncClient(transport=svc)
    pending = asyncio.ensure_future(client.sandboxes.list())
    await asyncio.sleep(0.01)
    await client.aclose()
    assert (svc.starts, svc.closes) == (1, 1)
    await pending  # its call was served: the service had started
