"""A guest that crashes, hangs or runs out of memory costs only its own VM.

A security-training agent attacks its own kernel: the sandbox is marked
failed with the guest's last console lines, the host and a neighbour VM
carry on. A guest OOM is the guest kernel's business: it kills the
process that asked, the sandbox keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator

import pytest

import corral
from corral.execd import protocol as proto
from corral.execd.client import ExecdClient
from corral.node.lifecycle import control_path
from corral.runtimes.vm import channel, qmp

from ..framework import IMAGE, Node

pytestmark = pytest.mark.requires_qemu


@pytest.fixture
async def watchful(fresh_node: Node) -> AsyncIterator[corral.AsyncClient]:
    """A node that looks for dead and hung guests every second and calls a
    guest hung after 6 s of silence (30 s by default)."""
    node = fresh_node.with_config(liveness_interval=1.0, vm_hang_timeout=6.0)
    async with node.client() as c:
        yield c
        await asyncio.gather(*(s.close() for s in await c.sandboxes.list()))


async def _wait_failed(sbx: corral.AsyncSandbox, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while (info := await sbx.refresh()).state.value != "failed":
        assert time.monotonic() < deadline, f"the fault was not noticed: {info.state}"
        await asyncio.sleep(0.5)
    assert info.error is not None
    return info.error


async def _pair(c: corral.AsyncClient) -> tuple[corral.AsyncSandbox, corral.AsyncSandbox]:
    victim, neighbour = await asyncio.gather(
        c.sandboxes.create(kind="microvm", image=IMAGE, memory="256MiB"),
        c.sandboxes.create(kind="microvm", image=IMAGE, memory="256MiB"),
    )
    return victim, neighbour


async def test_a_guest_kernel_crash_fails_only_its_vm(watchful: corral.AsyncClient) -> None:
    victim, neighbour = await _pair(watchful)
    with contextlib.suppress(corral.CorralError):
        await victim.commands.run("echo c > /proc/sysrq-trigger", timeout=10)
    error = await _wait_failed(victim, 30)
    assert "console lines" in error and "sysrq" in error.lower(), error
    assert (await neighbour.commands.run("echo alive")).stdout == "alive\n"


async def test_a_hung_guest_is_failed_with_its_console(watchful: corral.AsyncClient) -> None:
    """QEMU stays alive, the guest does not answer: a real-time spinner on
    the only vCPU starves everything else in the guest, its agent too."""
    victim, neighbour = await _pair(watchful)
    await victim.commands.start(
        "echo -1 > /proc/sys/kernel/sched_rt_runtime_us; "
        "exec chrt -f 99 sh -c 'while :; do :; done'"
    )
    t0 = time.monotonic()
    error = await _wait_failed(victim, 60)
    assert "stopped answering" in error and "console lines" in error, error
    assert time.monotonic() - t0 >= 5  # not before the hang timeout
    with pytest.raises(corral.SandboxFailed):
        await victim.commands.run("true")
    assert (await neighbour.commands.run("echo alive")).stdout == "alive\n"


async def test_a_guest_oom_kills_the_process_not_the_sandbox(
    watchful: corral.AsyncClient,
) -> None:
    victim, neighbour = await _pair(watchful)
    r = await victim.commands.run(
        "python3 -c 'x = []\nwhile True: x.append(bytearray(8 << 20))'", timeout=120
    )
    # Killed by the guest kernel's OOM killer (or refused an allocation).
    assert r.exit_code != 0, r
    assert (await victim.commands.run("echo still here")).stdout == "still here\n"
    assert (await victim.refresh()).state.value == "running"
    kern = await victim.commands.run("dmesg | grep -ci 'out of memory' || true")
    assert r.signal == 9 or int(kern.stdout.strip() or 0) > 0, (r, kern.stdout)
    assert (await neighbour.commands.run("echo alive")).stdout == "alive\n"


async def test_a_qemu_that_stops_answering_fails_a_suspend_not_the_node(
    embedded: corral.AsyncClient, node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A QEMU stopped in its tracks still has its control socket accept
    (the kernel queues the connection) and then never answers: the suspend
    fails in bounded time, naming the socket, and the sandbox runs on once
    QEMU does."""
    monkeypatch.setattr(qmp, "CONNECT_TIMEOUT", 2.0)
    monkeypatch.setattr(qmp, "REPLY_TIMEOUT", 2.0)
    sbx = await embedded.sandboxes.create(kind="microvm", image=IMAGE, memory="256MiB")
    pid = int((node.config.sandboxes_dir / sbx.id / "qemu.pid").read_text().split()[0])
    os.kill(pid, signal.SIGSTOP)
    try:
        began = time.monotonic()
        with pytest.raises(corral.SandboxFailed, match="control socket"):
            await sbx.suspend("disk")
        assert time.monotonic() - began < 20
        assert (await sbx.refresh()).state.value == "running"
    finally:
        os.kill(pid, signal.SIGCONT)
    assert (await sbx.commands.run("echo alive")).stdout == "alive\n"
    await sbx.suspend("disk")
    await sbx.resume()
    assert (await sbx.commands.run("echo back")).stdout == "back\n"


async def test_a_client_that_stops_reading_loses_its_stream_not_the_vm(
    embedded: corral.AsyncClient, node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every stream to the guest shares one port: a host client that stops
    reading (a slow consumer of a command's output) must not hold the
    others, the liveness pings among them, or the VM is failed as hung."""
    monkeypatch.setattr(channel, "STREAM_BACKLOG", 1 << 20)
    monkeypatch.setattr(channel, "SLOW_CLIENT_TIMEOUT", 1.0)
    sbx = await embedded.sandboxes.create(kind="microvm", image=IMAGE, memory="256MiB")
    client = ExecdClient(str(control_path(node.config.run_dir, sbx.id)))
    unread = await client.start(
        ["sh", "-c", "head -c 64000000 /dev/zero"], [], user="root", cwd="/", timeout=60,
        stdout_cap=1 << 30, stderr_cap=1024, stdin=None,
    )  # fmt: skip
    try:
        await asyncio.sleep(3)  # its backlog is full and the port waited on it
        async with asyncio.timeout(20):
            await client.ping()
            assert (await sbx.commands.run("echo alive")).stdout == "alive\n"
        got = 0
        with pytest.raises(ConnectionError):
            async with asyncio.timeout(20):
                async for kind, data in unread.events():
                    assert kind == proto.RSP_STDOUT, "the stream ran to its end"
                    got += len(data)
        assert got < 64_000_000
    finally:
        unread.close()
    assert (await sbx.refresh()).state.value == "running"
