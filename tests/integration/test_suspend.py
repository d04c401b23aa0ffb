"""Containers suspend and resume with their processes: frozen in place
(cgroup freezer, memory pushed out), resumed by a call or the next request,
in bulk by label, and by the node's idle policy."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import replace
from pathlib import Path

import pytest

import corral
from corral.host import swap
from corral.runtimes.container import criu

from ..framework import IMAGE, Node, zombies_of_this_process

# The count is replaced, not rewritten in place: a read never sees the
# file truncated and not yet written (which read as 0 and failed a test).
COUNTER = (
    'python3 -c "\nimport os,time\nn=0\nwhile True:\n  n+=1\n'
    "  open('/tmp/ticks.new','w').write(str(n)); os.replace('/tmp/ticks.new', '/tmp/ticks')\n"
    '  print(n, flush=True)\n  time.sleep(0.05)\n"'
)


async def _first_tick(bg: corral.AsyncCommandHandle) -> None:
    """Until the counter has counted (python starts in seconds, not
    milliseconds, on an emulated CPU: tests/framework/v2host.py)."""
    for _ in range(1200):
        if bg.stdout.strip():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the counter printed nothing in 60 s")


async def _ticks(sbx: corral.AsyncSandbox) -> int:
    return int((await sbx.files.read_text("/tmp/ticks")).strip() or 0)


async def _ticks_past(sbx: corral.AsyncSandbox, n: int) -> None:
    """Until the counter counts past `n`: it runs on (in tenths of a second
    here, in seconds on an emulated CPU)."""
    for _ in range(300):
        with contextlib.suppress(corral.FileNotFound):  # not yet written
            if await _ticks(sbx) > n:
                return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the counter stayed at {n} for 30 s")


async def _read_when_written(sbx: corral.AsyncSandbox, path: str) -> str:
    """Its first non-empty content (open(path, 'w') makes it empty first:
    the v2 guest once read it between the open and the write)."""
    for _ in range(600):
        with contextlib.suppress(corral.FileNotFound):
            if text := await sbx.files.read_text(path):
                return text
        await asyncio.sleep(0.1)
    raise AssertionError(f"{path} was not written in 60 s")


async def test_a_frozen_container_keeps_its_processes_and_stops_them(
    client: corral.AsyncClient,
) -> None:
    sbx = await client.sandboxes.create(image=IMAGE, memory="256MiB")
    await sbx.files.write("/tmp/state", "kept")
    bg = await sbx.commands.start(COUNTER)
    await _first_tick(bg)
    info = await sbx.suspend()
    assert (info.state, info.suspended) == ("suspended", "freeze")
    assert (await client.sandboxes.get(sbx.id)).info.state == "suspended"
    # Frozen: the counter does not move while suspended (read after resume).
    # A line printed just before the freeze may still be on its way here.
    await asyncio.sleep(0.3)
    seen = len(bg.stdout.split())
    await asyncio.sleep(0.6)
    assert len(bg.stdout.split()) == seen
    info = await sbx.resume()
    assert (info.state, info.suspended) == ("running", None)
    await _ticks_past(sbx, await _ticks(sbx))  # the same process runs on
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
    [("deep", "mode"), ("", "mode"), ("FREEZE", "mode"), ("disk ", "mode")],
)
async def test_bad_suspend_modes_are_refused_and_change_nothing(
    client: corral.AsyncClient, mode: str, field: str
) -> None:
    sbx = await client.sandboxes.create(image=IMAGE, memory="64MiB")
    with pytest.raises(corral.InvalidArgument) as err:
        await sbx.suspend(mode or " ")
    assert err.value.field == field and (mode or " ") in str(err.value)
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


async def _state_of(c: corral.AsyncClient, sandbox_id: str, want: str) -> corral.SandboxInfo:
    for _ in range(300):
        info = (await c.sandboxes.get(sandbox_id)).info
        if info.state == want:
            return info
        await asyncio.sleep(0.1)
    raise AssertionError(f"{sandbox_id} is {info.state}, not {want}, 30 s on")


async def test_a_ttl_ends_in_a_suspend_where_the_create_said_so(fresh_node: Node) -> None:
    """on_expiry (E2B's autoPause): the TTL's end suspends, and the
    sandbox then has no TTL until one is set; set_ttl(0) ends it now."""
    _needs_criu()
    async with fresh_node.client() as c:
        frozen = await c.sandboxes.create(image=IMAGE, memory="64MiB", ttl=1, on_expiry="suspend")
        on_disk = await c.sandboxes.create(image=IMAGE, memory="64MiB", ttl=600, on_expiry="disk")
        closes = await c.sandboxes.create(image=IMAGE, memory="64MiB", ttl=600)
        await frozen.files.write("/tmp/state", "kept")
        info = await _state_of(c, frozen.id, "suspended")
        assert (info.suspended, info.expires_at, info.on_expiry) == ("freeze", None, "suspend")
        await asyncio.sleep(1.5)  # no TTL: it stays, and the next request wakes it
        assert await frozen.files.read_text("/tmp/state") == "kept"
        assert (await c.sandboxes.get(frozen.id)).info.state == "running"
        # Now: within a second, as each create said.
        for sbx in (on_disk, closes):
            await sbx.set_ttl(0)
        info = await _state_of(c, on_disk.id, "suspended")
        assert info.suspended == "disk"
        await _state_of(c, closes.id, "closed")
        assert (await on_disk.commands.run("echo back")).stdout == "back\n"
        with pytest.raises(corral.InvalidArgument) as err:
            await c.sandboxes.create(image=IMAGE, ttl=1, on_expiry="pause")
        assert err.value.field == "on_expiry"
        await asyncio.gather(frozen.close(), on_disk.close())


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
                         ("swap_size", -1), ("checkpoint_wait", -1.0)):  # fmt: skip
        with pytest.raises(corral.InvalidArgument) as err:
            replace(node.config, **{field: value})
        assert err.value.field == field


# ------------------------------------------------------------------ to disk

SERVER = (
    'nohup python3 -c "\nimport os,socket,time\nx=bytearray(50<<20)\n'
    "open('/tmp/born','w').write(repr(time.time()))\n"
    "for i in range(0,len(x),4096): x[i]=1\n"
    "s=socket.socket(); s.bind(('127.0.0.1',9000)); s.listen()\n"
    "c=socket.create_connection(('127.0.0.1',9000)); a,_=s.accept()\nn=0\n"
    "while True:\n  n+=1; c.send(b'x'); a.recv(1)\n"
    "  open('/tmp/ticks.new','w').write(str(n)); os.replace('/tmp/ticks.new','/tmp/ticks')\n"
    '  time.sleep(0.05)\n" >/tmp/server.log 2>&1 &'
)


def _live_tasks(dirs: list[Path]) -> list[str]:
    out = []
    for d in dirs:
        for pid in (d / "cgroup.procs").read_text().split() if d.exists() else []:
            stat = Path(f"/proc/{pid}/stat")
            if stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
                out.append(pid)
    return out


def _needs_criu() -> None:
    why = criu.available()
    if why is not None:
        pytest.fail(f"containers suspend to disk with CRIU: {why} (make install builds it)")


async def test_a_container_suspended_to_disk_holds_no_process_and_comes_back(
    client: corral.AsyncClient, node: Node
) -> None:
    _needs_criu()
    sbx = await client.sandboxes.create(image=IMAGE, memory="256MiB")
    await sbx.files.write("/tmp/state", "kept")
    await sbx.commands.run(SERVER)
    born = await _read_when_written(sbx, "/tmp/born")
    await _ticks_past(sbx, 0)
    for _ in range(2):  # twice: a restored sandbox checkpoints again
        before = await _ticks(sbx)
        info = await sbx.suspend("disk")
        assert (info.state, info.suspended) == ("suspended", "disk")
        cg = node.agent.parts.cgroups if client.url is None else None
        if cg is not None:  # nothing runs (an init not yet reaped may linger)
            assert _live_tasks(cg.dirs(sbx.id)) == []
        await asyncio.sleep(0.3)
        info = await sbx.resume()
        assert info.state == "running"
        after = await _ticks(sbx)
        # Counted on from where it was, by the same process (a new one would
        # write a new birth), not from an older checkpoint (the second round
        # would read less). No upper bound: under load the counter ticks on
        # between the read and the dump and between the restore and the read
        # (CI once saw 6 ticks, 300 ms).
        assert after >= before
        assert await sbx.files.read_text("/tmp/born") == born
        await _ticks_past(sbx, after)  # its process, its socket pair, run on
    assert (await sbx.files.read_text("/tmp/state")) == "kept"
    # init's park socket (its way back, docs/preemption.md) is gone once unparked.
    unix = await sbx.files.read_text("/proc/net/unix")
    assert "corral-park" not in unix and "corral-ctl" not in unix
    log = await sbx.files.read_text("/tmp/server.log")
    assert "Error" not in log, log
    await sbx.close()


async def test_the_next_request_restores_a_container_from_disk(client: corral.AsyncClient) -> None:
    _needs_criu()
    sbx = await client.sandboxes.create(image=IMAGE, memory="64MiB")
    await sbx.commands.run("echo 41 > /tmp/x")
    await sbx.suspend("disk")
    assert (await sbx.commands.run("echo $(( $(cat /tmp/x) + 1 ))")).stdout == "42\n"
    await sbx.close()


async def test_disk_waits_for_a_command_to_end_then_is_refused(node: Node) -> None:
    _needs_criu()
    async with node.with_config(checkpoint_wait=1.0).client() as c:
        sbx = await c.sandboxes.create(image=IMAGE, memory="64MiB")
        # One about to end is waited for.
        ending = asyncio.create_task(sbx.commands.run("sleep 0.3; echo done"))
        await asyncio.sleep(0.1)
        assert (await sbx.suspend("disk")).suspended == "disk"
        assert (await ending).stdout == "done\n"
        # One that goes on is not: refused, and nothing changes.
        bg = await sbx.commands.start("sleep 30")
        with pytest.raises(corral.Conflict, match="command"):
            await sbx.suspend("disk")
        assert (await c.sandboxes.get(sbx.id)).info.state == "running"
        # A frozen one goes to disk only once idle: the freeze keeps the command.
        await sbx.suspend("freeze")
        with pytest.raises(corral.Conflict, match="command"):
            await sbx.suspend("disk")
        await bg.kill()
        await sbx.close()


@pytest.mark.parametrize("first", ["suspend", "resume"])
async def test_a_suspend_or_resume_asked_during_the_other_waits_for_it_then_acts(
    first: str, client: corral.AsyncClient, node: Node
) -> None:
    """A resume asked while a checkpoint runs resumes once it has ended;
    a suspend asked while a resume runs suspends once it has (both were a
    Conflict, and a preemption hook's suspend lost to a request's resume)."""
    _needs_criu()
    sbx = await client.sandboxes.create(image=IMAGE, memory="64MiB")
    await sbx.files.write("/tmp/kept", "yes")
    if first == "resume":
        await sbx.suspend("disk")
    moving = asyncio.create_task(sbx.suspend("disk") if first == "suspend" else sbx.resume())
    middle = "suspending" if first == "suspend" else "resuming"
    for _ in range(20000):  # polled: the state lives in the node's store
        rec = node.record(sbx.id)
        if rec is not None and rec.state == middle:
            break
        await asyncio.sleep(0.0005)
    else:
        pytest.fail(f"the sandbox never showed {middle}")
    second = await (sbx.resume() if first == "suspend" else sbx.suspend("disk"))
    assert (await moving).state == ("suspended" if first == "suspend" else "running")
    assert second.state == ("running" if first == "suspend" else "suspended"), second
    assert (await sbx.files.read_text("/tmp/kept")) == "yes"  # a request resumes it either way
    await sbx.close()


@pytest.mark.parametrize("change", ["suspend", "resume"])
async def test_a_close_during_a_suspend_or_resume_closes_the_sandbox(
    change: str, client: corral.AsyncClient, node: Node
) -> None:
    """The close waits for the change in flight and then closes (before, it
    returned at once and the sandbox stayed, suspended or running)."""
    _needs_criu()
    sbx = await client.sandboxes.create(image=IMAGE, memory="64MiB")
    if change == "resume":
        await sbx.suspend("disk")
    moving = asyncio.create_task(sbx.suspend("disk") if change == "suspend" else sbx.resume())
    middle = f"{change.removesuffix('e')}ing"
    for _ in range(20000):  # polled: the state lives in the node's store
        rec = node.record(sbx.id)
        if rec is not None and rec.state == middle:
            break
        await asyncio.sleep(0.0005)
    else:
        pytest.fail(f"the sandbox was never seen {middle}")
    await sbx.close()
    assert node.record(sbx.id).state == "closed"  # type: ignore[union-attr]
    await asyncio.gather(moving, return_exceptions=True)  # its own outcome
    assert node.resources(sbx.id) == []


async def test_closing_a_container_suspended_to_disk_releases_it(node: Node) -> None:
    _needs_criu()
    async with node.client() as c:
        sbx = await c.sandboxes.create(image=IMAGE, memory="64MiB")
        await sbx.suspend("disk")
        await sbx.close()
        assert node.record(sbx.id).state == "closed"  # type: ignore[union-attr]
        assert node.resources(sbx.id) == []


async def test_idle_sandboxes_go_to_disk_after_a_while(fresh_node: Node) -> None:
    _needs_criu()
    idle = fresh_node.with_config(suspend_after=0.5, suspend_to_disk_after=0.5)
    async with idle.client() as c:
        sbx = await c.sandboxes.create(image=IMAGE, memory="64MiB")
        for _ in range(100):
            info = (await c.sandboxes.get(sbx.id)).info
            if info.suspended == "disk":
                break
            await asyncio.sleep(0.1)
        assert (info.state, info.suspended) == ("suspended", "disk")
        assert (await sbx.commands.run("echo back")).stdout == "back\n"
        await sbx.close()


@pytest.mark.parametrize("mode", ["freeze", "disk"])
async def test_a_suspended_container_outlives_its_agent(fresh_node: Node, mode: str) -> None:
    """The agent that suspended it stops (a trainer's embedded node); the
    next agent of the node resumes it, processes and all, and a restored
    one closes leaving nothing."""
    if mode == "disk":
        _needs_criu()
    async with fresh_node.client() as c:
        sbx = await c.sandboxes.create(image=IMAGE, memory="128MiB")
        await sbx.commands.run(f"nohup {COUNTER} >/dev/null 2>&1 &")
        await _ticks_past(sbx, 0)  # counting (a fixed 0.5 s was short in the v2 guest)
        await sbx.suspend(mode)
    async with fresh_node.client() as c:
        again = await c.sandboxes.get(sbx.id)
        assert (again.info.state, again.info.suspended) == ("suspended", mode)
        before = await _ticks(again)  # resumes it
        await _ticks_past(again, before)
        await again.close()
        assert fresh_node.resources(sbx.id) == []
        assert _live_tasks(fresh_node.agent.parts.cgroups.dirs(sbx.id)) == []


RESIDENT = """
import os, time
x = bytearray(os.urandom(1 << 20)) * 64   # 64 MiB, touched, incompressible-ish
want = sum(x[::4096])
os.mkfifo("/tmp/ask")
while True:
    with open("/tmp/ask") as f:
        f.read()
    with open("/tmp/answer.tmp", "w") as f:
        f.write("intact" if sum(x[::4096]) == want else "changed")
    os.replace("/tmp/answer.tmp", "/tmp/answer")
"""


async def test_an_idle_container_gives_its_memory_back_and_gets_it_again(
    fresh_node: Node,
) -> None:
    """reclaim_after: a running container with no command for that long
    gives its memory to (z)swap, still running; its next command faults
    back what it touches, contents intact."""
    node = fresh_node.with_config(swap_size=1 << 30, reclaim_after=1.0)
    async with node.client() as c:
        if not swap.active(node.config.data_dir / "swap"):
            pytest.skip("the host refused a swap file (swapon): nothing to reclaim to")
        sbx = await c.sandboxes.create(image=IMAGE, memory="256MiB")
        await sbx.files.write("/tmp/resident.py", RESIDENT.encode())
        # A daemon, not a running command: a sandbox running a command is busy.
        await sbx.commands.run("nohup python3 /tmp/resident.py >/dev/null 2>&1 &")
        # Its memory held (it makes the fifo after): the idle spell starts
        # after this request. An emulated CPU's python took longer than
        # reclaim_after to get there, and the spell's one reclaim came first.
        for _ in range(1200):
            if await sbx.files.exists("/tmp/ask"):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the resident process never held its memory in 60 s")
        cg = node.agent.parts.cgroups
        peak = 0
        for _ in range(200):
            peak = max(peak, cg.memory_usage(sbx.id) or 0)
            if (cg.memory_usage(sbx.id) or 0) < 16 << 20 and peak > 64 << 20:
                break
            await asyncio.sleep(0.1)
        assert peak > 64 << 20, f"the resident process never held its 64 MiB ({peak})"
        assert (cg.memory_usage(sbx.id) or 0) < 16 << 20, "the idle sandbox kept its memory"
        assert (await c.sandboxes.get(sbx.id)).info.state == "running"
        r = await sbx.commands.run(
            "echo x > /tmp/ask; for i in $(seq 100); do [ -f /tmp/answer ] && break; sleep 0.1; done;"
            " cat /tmp/answer",
            timeout=60,
        )
        assert r.stdout == "intact"  # every page read back, from (z)swap
        await sbx.close()


@pytest.mark.requires_qemu
async def test_an_idle_microvm_gives_its_memory_back_and_gets_it_again(
    fresh_node: Node,
) -> None:
    """reclaim_after on a VM: its cgroup holds QEMU, so the guest's memory
    (and the emulator's) goes to (z)swap while the guest runs on; the next
    command finds a file the guest wrote before, intact."""
    node = fresh_node.with_config(swap_size=1 << 30, reclaim_after=2.0)
    async with node.client() as c:
        if not swap.active(node.config.data_dir / "swap"):
            pytest.skip("the host refused a swap file (swapon): nothing to reclaim to")
        sbx = await c.sandboxes.create(kind="microvm", image=IMAGE, memory="256MiB")
        r = await sbx.commands.run("head -c 48M /dev/urandom > /tmp/blob && md5sum < /tmp/blob")
        assert r.exit_code == 0, r.stderr
        digest = r.stdout.split()[0]
        cg = node.agent.parts.cgroups
        peak = cg.memory_usage(sbx.id) or 0
        assert peak > 96 << 20, f"the guest never held its 48 MiB file ({peak})"
        for _ in range(300):
            if (cg.memory_usage(sbx.id) or 0) < peak // 2:
                break
            await asyncio.sleep(0.1)
        assert (cg.memory_usage(sbx.id) or 0) < peak // 2, "the idle VM kept its memory"
        r = await sbx.commands.run("md5sum < /tmp/blob", timeout=120)
        assert r.stdout.split()[0] == digest  # read back from (z)swap
        await sbx.close()


async def _one_init(node: Node, sandbox_id: str) -> bool:
    """Whether one init process runs in the sandbox's cgroups, once the one
    a checkpoint ended has finished exiting (under load that takes a while;
    a second live tree does not go away)."""
    for _ in range(100):
        inits = []
        for pid in node.init_processes():
            try:
                if sandbox_id in Path(f"/proc/{pid}/cgroup").read_text():
                    inits.append(pid)
            except OSError:
                continue  # gone meanwhile
        if len(inits) == 1:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_a_cancelled_resume_still_ends_running(
    client: corral.AsyncClient, node: Node
) -> None:
    """The caller stops waiting; the resume goes on. Before, a cancel during
    CRIU's restore left the restored tree running under a record that said
    suspended, and the next resume failed on it."""
    _needs_criu()
    sbx = await client.sandboxes.create(image=IMAGE, memory="64MiB")
    await sbx.commands.run("echo kept > /tmp/state")
    for delay in (0.0, 0.02, 0.08, 0.2):
        await sbx.suspend("disk")
        resuming = asyncio.create_task(sbx.resume())
        await asyncio.sleep(delay)
        if not resuming.done():  # a restore here takes ~0.1-0.3 s
            resuming.cancel()
            with pytest.raises(asyncio.CancelledError):
                await resuming
        info = await sbx.resume()  # waits for the one in flight, or finds it done
        assert info.state == "running", (delay, info)
        assert (await sbx.files.read_text("/tmp/state")) == "kept\n"
        # One tree, not a second restore beside it.
        assert await _one_init(node, sbx.id), delay
    await sbx.close()


async def test_a_cancelled_suspend_still_ends_suspended_or_running(
    client: corral.AsyncClient, node: Node
) -> None:
    """As a resume: the caller stops waiting, the suspend goes on, and the
    sandbox is whole either way."""
    _needs_criu()
    sbx = await client.sandboxes.create(image=IMAGE, memory="64MiB")
    await sbx.commands.run("echo kept > /tmp/state")
    for delay in (0.0, 0.02, 0.05, 0.1, 0.2):
        suspending = asyncio.create_task(sbx.suspend("disk"))
        await asyncio.sleep(delay)
        if not suspending.done():
            suspending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await suspending
        for _ in range(500):  # the suspend in flight ends
            if (await client.sandboxes.get(sbx.id)).info.state in ("running", "suspended"):
                break
            await asyncio.sleep(0.01)
        assert (await sbx.files.read_text("/tmp/state")) == "kept\n", delay
        assert (await sbx.resume()).state == "running"
        assert await _one_init(node, sbx.id), delay
    await sbx.close()


async def test_a_resume_that_breaks_after_the_restore_fails_the_sandbox(
    fresh_node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CRIU restores the tree, then the sandbox does not answer (injected:
    the readiness check fails once). Its processes run, so it cannot go
    back to "suspended" (before, it did, with the restored tree running
    beside the record); it fails, and nothing of it is left."""
    _needs_criu()
    from corral.errors import SandboxFailed
    from corral.node import snapshots

    async with fresh_node.client() as c:
        sbx = await c.sandboxes.create(image=IMAGE, memory="64MiB")
        await sbx.suspend("disk")
        real = snapshots.wait_ready

        async def never_ready(sandbox_id: str, *args: object) -> None:
            raise SandboxFailed("injected: the exec server did not answer", sandbox=sandbox_id)

        monkeypatch.setattr(snapshots, "wait_ready", never_ready)
        with pytest.raises(SandboxFailed, match="once its state was loaded"):
            await sbx.resume()
        monkeypatch.setattr(snapshots, "wait_ready", real)
        info = (await c.sandboxes.get(sbx.id)).info
        assert info.state == "failed", info
        assert "injected" in (info.error or "")
    assert fresh_node.records() == []
    assert fresh_node.leftovers() == {}


@pytest.mark.requires_qemu
async def test_an_embedded_caller_keeps_no_zombie_of_its_vms(fresh_node: Node) -> None:
    """QEMU is the agent's own child, in a caller's process too: a closed or
    suspended VM's QEMU is reaped by the agent (before, it stayed a zombie
    until the caller's next subprocess happened to collect it)."""
    async with fresh_node.client() as c:
        vm = await c.sandboxes.create(kind="microvm", image=IMAGE, memory="256MiB")
        await vm.suspend()  # QEMU saves the guest and quits
        assert await _no_zombie_soon(), zombies_of_this_process()
        await vm.resume()
        await vm.close()
        assert await _no_zombie_soon(), zombies_of_this_process()


async def _no_zombie_soon() -> bool:
    for _ in range(60):  # the agent's tick reaps (reaper_interval)
        if not zombies_of_this_process():
            return True
        await asyncio.sleep(0.05)
    return False


def _stuck_criu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A CRIU that takes its arguments and never ends (a real one stuck on
    a task in D state looks the same from the node), and a short bound."""
    stub = tmp_path / "criu"
    stub.write_text('#!/bin/sh\necho $$ >> "$0.pids"\nexec sleep 600\n')
    stub.chmod(0o755)
    monkeypatch.setattr(criu, "CRIU", str(stub))
    monkeypatch.setattr(criu, "HELPER_TIMEOUT", 3.0)
    return stub


def _all_gone(stub: Path) -> bool:
    pids = stub.with_name("criu.pids").read_text().split()
    return bool(pids) and not any(Path(f"/proc/{p}").exists() for p in pids)


async def test_a_stuck_criu_fails_a_suspend_and_the_sandbox_runs_on(
    fresh_node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, nothing bounded CRIU: a stuck dump held the sandbox's change,
    and its close, for ever. Now it is killed at HELPER_TIMEOUT, the
    suspend fails naming it, and the sandbox is thawed and runs on."""
    _needs_criu()
    async with fresh_node.client() as c:
        sbx = await c.sandboxes.create(image=IMAGE, memory="64MiB")
        await sbx.commands.run("echo kept > /tmp/x")
        stub = _stuck_criu(tmp_path, monkeypatch)
        began = asyncio.get_running_loop().time()
        with pytest.raises(corral.SandboxFailed, match="ran past 3 s and was killed"):
            await sbx.suspend("disk")
        assert asyncio.get_running_loop().time() - began < 30
        assert _all_gone(stub)
        assert (await sbx.refresh()).state.value == "running"
        assert (await sbx.commands.run("cat /tmp/x")).stdout == "kept\n"
        monkeypatch.undo()
        await sbx.suspend("disk")  # the real CRIU: it was left as it was
        assert (await sbx.commands.run("cat /tmp/x")).stdout == "kept\n"
        await sbx.close()
    assert fresh_node.leftovers() == {}


async def test_a_stuck_criu_fails_a_resume_and_the_checkpoint_is_kept(
    fresh_node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restore that never ends is killed at HELPER_TIMEOUT; nothing of
    the sandbox ran yet, so its checkpoint on disk still holds it: the
    resume fails, and the next one (with a CRIU that works) brings it back."""
    _needs_criu()
    async with fresh_node.client() as c:
        sbx = await c.sandboxes.create(image=IMAGE, memory="64MiB")
        await sbx.commands.run("echo kept > /tmp/x")
        await sbx.suspend("disk")
        stub = _stuck_criu(tmp_path, monkeypatch)
        began = asyncio.get_running_loop().time()
        with pytest.raises(corral.SandboxFailed, match="ran past 3 s and was killed"):
            await sbx.resume()
        assert asyncio.get_running_loop().time() - began < 30
        assert _all_gone(stub)
        info = (await c.sandboxes.get(sbx.id)).info
        monkeypatch.undo()
        assert (info.state, info.suspended) == ("suspended", "disk"), info
        assert (await sbx.commands.run("cat /tmp/x")).stdout == "kept\n"
        await sbx.close()
    assert fresh_node.records() == []
    assert fresh_node.leftovers() == {}
