"""A caller that cancels a create (a trainer's step timing out, an
environment reset): at whatever point of the create the cancel lands, the
caller gets CancelledError, never a sandbox, and nothing of the sandbox is
left on the host or in the records.

Before Corral stopped using asyncio.wait_for (now refused by ruff, see
pyproject.toml), about one cancel in 25 landing near the end of the create
was dropped: the create returned a running sandbox that its caller had
given up on."""

from __future__ import annotations

import asyncio
import collections

import pytest

from ..framework import IMAGE, Node

STEP = 0.00025  # s between cancel points; a cold create takes ~7-15 ms here
POINTS = 60


async def test_a_cancelled_create_is_cancelled_and_leaves_nothing(fresh_node: Node) -> None:
    seen: collections.Counter[str] = collections.Counter()
    async with fresh_node.client() as c:
        await (await c.sandboxes.create(image=IMAGE)).close()  # caches warm
        for i in range(2 * POINTS):
            task = asyncio.create_task(c.sandboxes.create(image=IMAGE))
            await asyncio.sleep((i % POINTS) * STEP)
            if task.done():  # finished before the cancel: not this test's case
                seen["done before the cancel"] += 1
                await task.result().close()
                continue
            task.cancel()
            try:
                made = await task
            except asyncio.CancelledError:
                seen["cancelled"] += 1
            else:
                seen["returned a sandbox after its cancel"] += 1
                await made.close()
        assert seen["returned a sandbox after its cancel"] == 0, seen
        assert seen["cancelled"] >= POINTS // 2, seen  # the sweep hit the create's path
        assert await c.sandboxes.list() == []
    assert fresh_node.records() == []
    assert fresh_node.leftovers() == {}


async def test_a_cancelled_close_still_closes_everything(fresh_node: Node) -> None:
    """Before, a close cancelled half-way left the sandbox "closing" with
    its cgroups, disk and processes held, and a second close returned at
    once without closing it."""
    cancelled = 0
    async with fresh_node.client() as c:
        for i in range(POINTS // 2):
            sbx = await c.sandboxes.create(image=IMAGE)
            closing = asyncio.create_task(sbx.close())
            await asyncio.sleep(i * 2 * STEP)
            if not closing.done():
                closing.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await closing
                cancelled += 1
            await sbx.close()  # waits for the close in flight
            assert (await c.sandboxes.get(sbx.id)).info.state == "closed"
        assert cancelled >= POINTS // 8
    assert fresh_node.records() == []
    assert fresh_node.leftovers() == {}


async def test_a_cancelled_fork_leaves_the_source_alone_and_no_copy(fresh_node: Node) -> None:
    """All or nothing, cancels included: a copy made before the cancel
    landed is closed (nobody will ever see its id), and the source runs on.

    The sweep is fine near the start, where the source is parked: a cancel
    there had left its exec server with no listener (every later request
    refused), about one point in 150."""
    cancelled = 0
    async with fresh_node.client() as c:
        src = await c.sandboxes.create(image=IMAGE, memory="64MiB")
        await src.commands.run("echo kept > /tmp/state")
        delays = [i * 0.0006 for i in range(100)] + [0.1, 0.15, 0.2, 0.3]
        for delay in delays:
            forking = asyncio.create_task(c.sandboxes.fork(src, 2))
            await asyncio.sleep(delay)
            if forking.done():
                for copy in forking.result():
                    await copy.close()
                continue
            forking.cancel()
            cancelled += 1
            with pytest.raises(asyncio.CancelledError):
                await forking
            for _ in range(500):  # the copies made before the cancel are closing
                if [s.id for s in await c.sandboxes.list()] == [src.id]:
                    break
                await asyncio.sleep(0.01)
            assert [s.id for s in await c.sandboxes.list()] == [src.id], delay
            assert (await src.files.read_text("/tmp/state")) == "kept\n", delay
        await src.close()
    assert cancelled >= len(delays) // 2  # the sweep hit the fork's path
    assert fresh_node.records() == []
    assert fresh_node.leftovers() == {}


async def test_a_fork_cancelled_once_a_copy_runs_closes_that_copy(fresh_node: Node) -> None:
    async with fresh_node.client() as c:
        src = await c.sandboxes.create(image=IMAGE, memory="64MiB")
        caught = 0
        for _ in range(3):
            forking = asyncio.create_task(c.sandboxes.fork(src, 4))
            while not forking.done():
                made = fresh_node.records(labels={"corral.forked_from": src.id})
                if any(r.state == "running" for r in made):
                    forking.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await forking
                    caught += 1
                    break
                await asyncio.sleep(0.001)
            else:
                for copy in forking.result():
                    await copy.close()
                continue
            assert [s.id for s in await c.sandboxes.list()] == [src.id]
        assert caught >= 1
        await src.close()
    assert fresh_node.records() == []
    assert fresh_node.leftovers() == {}


async def test_a_create_whose_http_client_left_is_closed(fresh_node: Node) -> None:
    """Over HTTP the node does not see a cancel, only the connection going
    away: the create finishes there, and the sandbox it made, answered to
    nobody, is closed (before, it lived until its TTL). One with an
    idempotency key is kept: a retry with the key gets it."""
    fresh_node.server.start()
    try:
        async with fresh_node.http_client() as c:
            await (await c.sandboxes.create(image=IMAGE)).close()  # caches warm
            for delay in (0.002, 0.004, 0.006):
                creating = asyncio.create_task(c.sandboxes.create(image=IMAGE))
                await asyncio.sleep(delay)
                assert not creating.done()
                creating.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await creating
            keyed = asyncio.create_task(c.sandboxes.create(image=IMAGE, idempotency_key="left-1"))
            await asyncio.sleep(0.004)
            keyed.cancel()
            with pytest.raises(asyncio.CancelledError):
                await keyed
            for _ in range(200):  # the node finishes the creates, then closes them
                if len(await c.sandboxes.list()) == 1 and not fresh_node.records(["creating"]):
                    break
                await asyncio.sleep(0.05)
            (kept,) = await c.sandboxes.list()
            again = await c.sandboxes.create(image=IMAGE, idempotency_key="left-1")
            assert again.id == kept.id
            await again.close()
    finally:
        fresh_node.server.stop()
    assert fresh_node.records() == []
    assert fresh_node.leftovers() == {}
