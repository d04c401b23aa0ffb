"""TTL and idle timeout close sandboxes by themselves."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import corral
from corral.node.store import Store

from ..framework import IMAGE, Node


async def _wait_state(sbx: corral.AsyncSandbox, state: str, within: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < within:
        if (await sbx.refresh()).state.value == state:
            return time.monotonic() - t0
        await asyncio.sleep(0.1)
    raise AssertionError(f"{sbx.id} still {sbx.info.state.value} after {within}s")


async def test_ttl_closes_the_sandbox(embedded: corral.AsyncClient) -> None:
    sbx = await embedded.sandboxes.create(image=IMAGE, ttl=1.5, idle_timeout=None)
    assert sbx.info.expires_at is not None
    await _wait_state(sbx, "closed", 6)
    assert "ttl" in (sbx.info.error or "")


async def test_idle_timeout_closes_only_idle_sandboxes(embedded: corral.AsyncClient) -> None:
    idle = await embedded.sandboxes.create(image=IMAGE, idle_timeout=1.5)
    busy = await embedded.sandboxes.create(image=IMAGE, idle_timeout=1.5)
    for _ in range(12):
        await busy.commands.run("true")
        await asyncio.sleep(0.25)
    assert (await idle.refresh()).state.value == "closed"
    assert (await busy.refresh()).state.value == "running"


async def test_a_long_command_counts_as_activity(embedded: corral.AsyncClient) -> None:
    sbx = await embedded.sandboxes.create(image=IMAGE, idle_timeout=1.0)
    r = await sbx.commands.run("sleep 3; echo done", timeout=10)
    assert r.stdout == "done\n"
    assert (await sbx.refresh()).state.value == "running"


async def test_a_dead_init_fails_only_its_sandbox(fresh_node: Node) -> None:
    """The liveness pass (read off the loop, then checked again on the
    record) notices an init killed from outside; a neighbour carries on."""
    node = fresh_node.with_config(liveness_interval=0.5)
    async with node.client() as c:
        victim = await c.sandboxes.create(image=IMAGE, idle_timeout=None)
        neighbour = await c.sandboxes.create(image=IMAGE, idle_timeout=None)
        store = Store(node.config.db_path)
        rec = store.get(victim.id)
        store.close()
        assert rec is not None and rec.init_pid is not None
        os.kill(rec.init_pid, signal.SIGKILL)
        await _wait_state(victim, "failed", 10)
        assert "init process exited" in (victim.info.error or "")
        assert (await neighbour.commands.run("echo alive")).stdout == "alive\n"
        await asyncio.gather(victim.close(), neighbour.close())
