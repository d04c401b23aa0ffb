"""Warm sandboxes (node/warmpool.py): after a create, the node keeps a
sandbox of that stack started; the next create claims it and gets the
caller's limits, labels, env, class, key and network, exactly as a cold
one; warm sandboxes are hidden and refused until claimed; none is handed
out twice; nothing is left when the agent goes."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

import corral
from corral import labels
from corral.api.models import Window
from corral.host.cgroups import Mode
from corral.runtimes.vm import desktop

from ..framework import IMAGE, Node, png_pixels, require_image

SAME_AS_COLD = "cat /proc/self/uid_map; grep -E '^(Seccomp|NoNewPrivs|CapEff)' /proc/self/status"


async def warm_ids(node: Node, want: int, timeout: float = 30.0) -> list[str]:
    pool = node.agent.parts.warm
    deadline = asyncio.get_running_loop().time() + timeout
    while sum(len(q) for q in pool._ready.values()) < want:
        assert asyncio.get_running_loop().time() < deadline, "the pool did not refill"
        await asyncio.sleep(0.05)
    return [i for q in pool._ready.values() for i in q]


def cgroup(node: Node, controller: str, sandbox_id: str, name: str) -> str:
    d = node.agent.parts.cgroups._dir(controller, sandbox_id)
    assert d is not None
    return Path(d, name).read_text().strip()


async def test_a_create_claims_a_warm_sandbox_made_into_the_callers(fresh_node: Node) -> None:
    node = fresh_node.with_config(warm_pool=4, network_pool="10.219.0.0/16", dns_port=10269)
    async with node.client() as c:
        cold = await c.sandboxes.create(image=IMAGE, memory="128MiB")
        (warm,) = await warm_ids(node, 1)
        # Hidden and refused while warm.
        assert [s.id for s in await c.sandboxes.list()] == [cold.id]
        with pytest.raises(corral.PermissionDenied):
            await (await c.sandboxes.get(warm)).commands.run("true")
        claimed = await c.sandboxes.create(
            image=IMAGE, memory="200MiB", cpu=0.5, pids=64, disk="1GiB",
            labels={"job": "w"}, env={"GREETING": "hi"}, cpu_class="background",
            idempotency_key="warm-1", network={"ecosystems": {"pypi": True}}, ttl=600,
        )  # fmt: skip
        assert claimed.id == warm
        info = claimed.info
        assert (info.memory, info.cpu, info.pids, info.labels) == (200 << 20, 0.5, 64, {"job": "w"})
        assert info.cpu_class == "background" and info.network is not None
        assert info.expires_at is not None and info.expires_at - info.created_at == 600
        if node.agent.parts.cgroups.mode is Mode.V2:
            assert cgroup(node, "memory", warm, "memory.max") == str(200 << 20)
            assert cgroup(node, "cpu", warm, "cpu.max").split()[0] == "50000"
        else:
            assert cgroup(node, "memory", warm, "memory.limit_in_bytes") == str(200 << 20)
            assert cgroup(node, "cpu", warm, "cpu.cfs_quota_us") == "50000"
        assert cgroup(node, "pids", warm, "pids.max") == "64"
        assert cgroup(node, "cpu", warm, "cpu.idle") == "1"
        assert (await claimed.commands.run("echo $GREETING")).stdout == "hi\n"
        # The guard is the cold sandbox's, to the byte.
        assert (await claimed.commands.run(SAME_AS_COLD)).stdout == (
            await cold.commands.run(SAME_AS_COLD)
        ).stdout.replace(*_uid_maps(node, cold.id, warm))
        # Its network is connected as a cold one's would be: an interface
        # beside loopback, an address; the cold one without a policy has none.
        assert info.address is not None
        assert (await claimed.commands.run("ls /sys/class/net")).stdout.split() != ["lo"]
        assert (await cold.commands.run("ls /sys/class/net")).stdout.split() == ["lo"]
        # The key: the same create returns it, nothing claimed twice.
        again = await c.sandboxes.create(image=IMAGE, idempotency_key="warm-1")
        assert again.id == warm
        assert {s.id for s in await c.sandboxes.list()} == {cold.id, warm}
        assert warm not in await warm_ids(node, 1)
        await cold.close()
        await claimed.close()
    assert node.leftovers() == {}  # the agent closed what was still warm


def _uid_maps(node: Node, cold: str, warm: str) -> tuple[str, str]:
    """Each sandbox has its own block of host ids: the maps differ by it."""
    slots = node.agent.parts.admission
    return str(slots.host_id(cold)), str(slots.host_id(warm))


async def test_a_burst_is_served_warm_and_cold_alike(fresh_node: Node) -> None:
    node = fresh_node.with_config(warm_pool=8)
    async with node.client() as c:
        first = await c.sandboxes.create(image=IMAGE, memory="64MiB")
        await warm_ids(node, 1)
        boxes = await asyncio.gather(
            *(c.sandboxes.create(image=IMAGE, memory="64MiB", labels={"n": str(i)})
              for i in range(12))
        )  # fmt: skip
        assert len({b.id for b in boxes}) == 12
        for b in boxes:
            assert (await b.commands.run("echo ok")).stdout == "ok\n"
        listed = await c.sandboxes.list()
        assert labels.POOL not in {k for s in listed for k in s.info.labels}
        for b in [first, *boxes]:
            await b.close()
    assert node.leftovers() == {}


async def test_a_desktop_is_claimed_drawn_and_one_whose_session_died_is_not(
    fresh_node: Node,
) -> None:
    require_image(desktop.BASE)
    node = fresh_node.with_config(warm_pool=1)
    spec = {"image": desktop.BASE, "toolkit": [desktop.TOOLKIT], "memory": "1GiB"}
    async with node.client() as c:
        cold = await c.sandboxes.create(**spec, display_size="800x600")
        (warm,) = await _warm_desktops(node, "800x600")
        # Another screen size is another stack: created cold.
        other = await c.sandboxes.create(**spec, display_size="640x480")
        assert other.id != warm
        claimed = await c.sandboxes.create(**spec, display_size="800x600", labels={"w": "1"})
        assert claimed.id == warm and claimed.info.labels == {"w": "1"}
        # Handed out drawn, and driven like a cold one.
        _, _, rows = png_pixels(await claimed.display.screenshot())
        assert len(rows) == 600 and len({bytes(r) for r in rows}) > 1
        before = len(await claimed.display.windows())
        await claimed.display.launch("xterm")
        await _windows_until(claimed, before + 1)

        # A warm desktop whose X server died is closed at the claim, and
        # the create is served cold instead of failing.
        (dead,) = await _warm_desktops(node, "800x600")
        _kill(node, dead, "Xvfb")
        fresh = await c.sandboxes.create(**spec, display_size="800x600")
        assert fresh.id != dead
        _, _, rows = png_pixels(await fresh.display.screenshot())
        assert len({bytes(r) for r in rows}) > 1
        gone = node.agent.parts.cgroups._dir("pids", dead)
        assert gone is not None and not gone.exists()  # closed, not left warm
        for s in (cold, other, claimed, fresh):
            await s.close()
    assert node.leftovers() == {}


async def _warm_desktops(node: Node, size: str) -> list[str]:
    """The warm desktops of one screen size, once there is one."""
    pool = node.agent.parts.warm
    for _ in range(1200):
        ids = [i for k, q in pool._ready.items() if k[-1] == f"display={size}" for i in q]
        if ids:
            return ids
        await asyncio.sleep(0.1)
    raise AssertionError(f"no warm {size} desktop within 120 s")


def _kill(node: Node, sandbox_id: str, comm: str) -> None:
    """SIGKILL the sandbox's processes named `comm`, from the host."""
    procs = cgroup(node, "pids", sandbox_id, "cgroup.procs").split()
    named = [int(p) for p in procs if Path(f"/proc/{p}/comm").read_text().strip() == comm]
    assert named, f"no {comm} in {sandbox_id}"
    for pid in named:
        os.kill(pid, signal.SIGKILL)


async def _windows_until(s: corral.AsyncSandbox, n: int) -> list[Window]:
    for _ in range(200):
        wins = await s.display.windows()
        if len(wins) >= n:
            return wins
        await asyncio.sleep(0.1)
    raise AssertionError(f"fewer than {n} windows on {s.id}")
