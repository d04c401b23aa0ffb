"""Containers suspend and resume with their processes: frozen in place
(cgroup freezer, memory pushed out), resumed by a call or the next request,
in bulk by label, and by the node's idle policy."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import replace

import pytest

import corral
from corral.host import swap

from ..framework import IMAGE, Node

COUNTER = (
    'python3 -c "\nimport os,time\nn=0\nwhile True:\n  n+=1\n'
    "  open('/tmp/ticks','w').write(str(n))\n  print(n, flush=True)\n  time.sleep(0.05)\n\""
)


async def _ticks(sbx: corral.AsyncSandbox) -> int:
    return int((await sbx.files.read_text("/tmp/ticks")).strip() or 0)


async def test_a_frozen_container_keeps_its_processes_and_stops_them(
    client: corral.AsyncClient,
) -> None:
    sbx = await client.sandboxes.create(image=IMAGE, memory="256MiB")
    await sbx.files.write("/tmp/state", "kept")
    bg = await sbx.commands.start(COUNTER)
    await asyncio.sleep(0.5)
    info = await sbx.suspend()
    assert (info.state, info.suspended) == ("suspended", "freeze")
    assert (await client.sandboxes.get(sbx.id)).info.state == "suspended"
    # Frozen: the counter does not move while suspended (read after resume).
    seen = len(bg.stdout.split())
    await asyncio.sleep(0.6)
    assert len(bg.stdout.split()) == seen
    info = await sbx.resume()
    assert (info.state, info.suspended) == ("running", None)
    before = await _ticks(sbx)
    await asyncio.sleep(0.4)
    assert await _ticks(sbx) > before  # the same process runs on
    # Its output stream continued: one connection, numbers without a gap.
    numbers = [int(x) for x in bg.stdout.split()]
    assert numbers == list(range(1, len(numbers) + 1))
    assert (await sbx.commands.run(f"kill -0 {bg.pid}")).ok  # the same pid
    assert (await sbx.files.read_text("/tmp/state")) == "kept"
    await bg.kill()
    await sbx.close()


async def test_the_next_request_resumes_a_frozen_container(client: corral.AsyncClient) -> None:
    sbx = await client.sandboxes.create(image=IMAGE, memory="128MiB")
    await sbx.suspend()
    r = await sbx.commands.run("echo awake")
    assert r.stdout == "awake\n"
    assert (await client.sandboxes.get(sbx.id)).info.state == "running"
    await sbx.suspend()
    assert await sbx.files.read_text("/etc/hostname")
    assert (await client.sandboxes.get(sbx.id)).info.state == "running"
    # Suspending what is suspended is a no-op; resuming what runs too.
    await sbx.suspend()
    assert (await sbx.suspend()).state == "suspended"
    await sbx.resume()
    assert (await sbx.resume()).state == "running"
    await sbx.close()


async def test_closing_a_frozen_container_releases_it(node: Node) -> None:
    async with node.client() as c:
        sbx = await c.sandboxes.create(image=IMAGE, memory="128MiB")
        await sbx.commands.start("sleep 1000")
        await sbx.suspend()
        await sbx.close()
        assert node.record(sbx.id).state == "closed"  # type: ignore[union-attr]
        assert node.resources(sbx.id) == []


async def test_a_keyed_suspend_acts_once(client: corral.AsyncClient) -> None:
    sbx = await client.sandboxes.create(image=IMAGE, memory="128MiB")
    key = f"preempt-{secrets.token_hex(4)}"
    assert (await sbx.suspend(key=key)).state == "suspended"
    await sbx.resume()
    # The preemption hook retried: the sandbox resumed since stays running.
    assert (await sbx.suspend(key=key)).state == "running"
    assert (await sbx.suspend(key=f"{key}-2")).state == "suspended"
    await sbx.close()


async def test_suspend_many_and_resume_many_by_label(client: corral.AsyncClient) -> None:
    job = secrets.token_hex(4)
    made = await client.sandboxes.create_many(
        {"image": IMAGE, "memory": "64MiB", "labels": {"job": job}}, 4
    )
    other = await client.sandboxes.create(image=IMAGE, memory="64MiB", labels={"job": "x"})
    out = await client.sandboxes.suspend_many({"job": job}, concurrency=2, key=job)
    assert sorted(o.id for o in out) == sorted(s.id for s in made)  # type: ignore[union-attr]
    assert all(o.ok and o.info and o.info.state == "suspended" for o in out)
    assert (await client.sandboxes.get(other.id)).info.state == "running"
    back = await client.sandboxes.resume_many({"job": job})
    assert all(o.ok and o.info and o.info.state == "running" for o in back)
    # Retried with the same key: nothing is suspended again.
    again = await client.sandboxes.suspend_many({"job": job}, key=job)
    assert all(o.info and o.info.state == "running" for o in again)
    with pytest.raises(corral.InvalidArgument, match="labels"):
        await client.sandboxes.suspend_many({})


@pytest.mark.parametrize(
    ("mode", "field"),
    [("deep", "mode"), ("disk", "mode"), ("FREEZE", "mode")],
)
async def test_bad_suspend_modes_are_refused_and_change_nothing(
    client: corral.AsyncClient, mode: str, field: str
) -> None:
    sbx = await client.sandboxes.create(image=IMAGE, memory="64MiB")
    with pytest.raises(corral.InvalidArgument) as err:
        await sbx.suspend(mode)
    assert err.value.field == field and mode in str(err.value)
    assert (await client.sandboxes.get(sbx.id)).info.state == "running"
    await sbx.close()


async def test_suspending_a_closed_or_changing_sandbox_is_refused(
    client: corral.AsyncClient,
) -> None:
    sbx = await client.sandboxes.create(image=IMAGE, memory="64MiB")
    await sbx.close()
    with pytest.raises(corral.CorralError, match="closed"):
        await sbx.suspend()
    with pytest.raises(corral.SandboxNotFound):
        await client._service.suspend("t-0000000000000000", "", "")  # type: ignore[attr-defined]
    # Two suspends at once: one freezes, the other is refused or sees it done.
    sbx = await client.sandboxes.create(image=IMAGE, memory="64MiB")
    results = await asyncio.gather(sbx.suspend(), sbx.suspend(), return_exceptions=True)
    for r in results:
        assert isinstance(r, corral.SandboxInfo | corral.Conflict), r
    assert (await client.sandboxes.get(sbx.id)).info.state == "suspended"
    await sbx.close()


async def test_a_function_call_worker_cannot_be_suspended(node: Node) -> None:
    async with node.client() as c:
        sbx = await c.sandboxes.create(kind="fncall", image="fncall:bookworm", memory="256MiB")
        with pytest.raises(corral.InvalidArgument, match="kind"):
            await sbx.suspend()
        await sbx.close()


async def test_idle_sandboxes_are_frozen_by_the_node(fresh_node: Node) -> None:
    # A node of its own: its agent leads (the idle policy is the leader's).
    idle = fresh_node.with_config(suspend_after=1.0)
    async with idle.client() as c:
        sbx = await c.sandboxes.create(image=IMAGE, memory="64MiB")
        busy = await c.sandboxes.create(image=IMAGE, memory="64MiB")
        run = asyncio.create_task(busy.commands.run("sleep 4", timeout=30))
        for _ in range(100):
            if (await c.sandboxes.get(sbx.id)).info.state == "suspended":
                break
            await asyncio.sleep(0.1)
        info = (await c.sandboxes.get(sbx.id)).info
        assert (info.state, info.suspended) == ("suspended", "freeze")
        # A sandbox running a command is not idle.
        assert (await c.sandboxes.get(busy.id)).info.state == "running"
        assert (await run).ok
        assert (await sbx.commands.run("echo back")).stdout == "back\n"
        await asyncio.gather(sbx.close(), busy.close())


async def test_a_frozen_container_gives_its_memory_to_swap(fresh_node: Node) -> None:
    swapped = fresh_node.with_config(swap_size=1 << 30)
    async with swapped.client() as c:
        if not swap.active(swapped.config.data_dir / "swap"):
            pytest.skip("the host refused a swap file (swapon): no swap for frozen sandboxes")
        sbx = await c.sandboxes.create(image=IMAGE, memory="256MiB")
        await sbx.commands.start(
            'python3 -c "\nimport time\nx=bytearray(64<<20)\n'
            'for i in range(0,len(x),4096): x[i]=1\ntime.sleep(1000)"'
        )
        cg = swapped.agent.parts.cgroups
        for _ in range(100):
            if (cg.memory_usage(sbx.id) or 0) > 64 << 20:
                break
            await asyncio.sleep(0.1)
        await sbx.suspend()
        await swapped.agent.parts.snapshots.settled(sbx.id)
        assert (cg.memory_usage(sbx.id) or 0) < 16 << 20
        assert (await sbx.commands.run("echo alive")).ok
        await sbx.close()
    # The node's last agent, its last sandbox gone, turns its swap off.
    assert not swap.active(swapped.config.data_dir / "swap")


def test_suspend_policy_settings_are_checked(node: Node) -> None:
    for field, value in (("suspend_after", -1.0), ("suspend_to_disk_after", 1e9),
                         ("swap_size", -1)):  # fmt: skip
        with pytest.raises(corral.InvalidArgument) as err:
            replace(node.config, **{field: value})
        assert err.value.field == field
