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
