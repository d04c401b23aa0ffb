"""Admission on the real host: CPUs promised beyond cpus x cpu_overcommit,
free memory under the reserve and a pressure stall at its limit each
refuse a create with NodeFull naming the reason, and a refused create
leaves nothing behind (docs/admission.md)."""

from __future__ import annotations

import asyncio
import os

import pytest

import corral
from corral.host import pressure as psi

from ..framework import IMAGE, Node


async def test_cpus_promised_past_the_overcommit_are_refused(fresh_node: Node) -> None:
    node = fresh_node.with_config(cpu_overcommit=1.0)
    cpus = os.cpu_count() or 1
    async with node.client() as c:
        held = [await c.sandboxes.create(image=IMAGE, cpu=1.0, memory="64MiB") for _ in range(cpus)]
        with pytest.raises(corral.NodeFull) as exc:
            await c.sandboxes.create(image=IMAGE, cpu=0.5, memory="64MiB")
        assert exc.value.details["reason"] == "cpu"
        assert f"{cpus} CPUs x cpu_overcommit 1" in exc.value.message
        assert len(await c.sandboxes.list()) == cpus  # nothing half-made
        await held[0].close()
        await (await c.sandboxes.create(image=IMAGE, cpu=0.5, memory="64MiB")).close()
        for s in held[1:]:
            await s.close()
    assert node.leftovers() == {}


async def test_free_memory_under_the_reserve_refuses(fresh_node: Node) -> None:
    free = psi.mem_available()
    assert free is not None, "no MemAvailable in /proc/meminfo"
    node = fresh_node.with_config(memory_reserve=free + (64 << 30))
    async with node.client() as c:
        with pytest.raises(corral.NodeFull) as exc:
            await c.sandboxes.create(image=IMAGE, memory="64MiB")
        assert exc.value.details["reason"] == "memory_free"
        assert "under memory_reserve" in exc.value.message
        assert await c.sandboxes.list() == []
    assert node.leftovers() == {}


async def test_cpu_pressure_at_its_limit_refuses(fresh_node: Node) -> None:
    """Two agents of one node, one with a 5% CPU pressure limit, one with
    the default: under the same load the first refuses, the second admits."""
    if not psi.read():
        pytest.skip("requires pressure stall information (/proc/pressure, CONFIG_PSI)")
    strict = fresh_node.with_config(pressure_limits={"cpu": 5.0})
    cpus = os.cpu_count() or 1
    async with fresh_node.client() as c, strict.client() as s:
        hog = await c.sandboxes.create(image=IMAGE, cpu=float(cpus), memory="64MiB")
        # Twice as many spinning tasks as cores: a runnable task always waits.
        spin = await hog.commands.start(
            f"for i in $(seq {2 * cpus}); do (while :; do :; done) & done; wait", timeout=120
        )
        try:
            deadline = asyncio.get_running_loop().time() + 60
            while psi.read()["cpu"].some < 8.0:
                assert asyncio.get_running_loop().time() < deadline, "no CPU pressure built up"
                await asyncio.sleep(0.5)
            await asyncio.sleep(0.6)  # past the admission's cached reading
            with pytest.raises(corral.NodeFull) as exc:
                await s.sandboxes.create(image=IMAGE, memory="64MiB")
            assert exc.value.details["reason"] == "pressure"
            assert "cpu pressure (some avg10)" in exc.value.message
            await (await c.sandboxes.create(image=IMAGE, memory="64MiB")).close()
        finally:
            await spin.kill()
            await spin.wait()
        await hog.close()
    assert fresh_node.leftovers() == {}
