"""The VM guest agent's channel without a VM: corral-init `--serial` on one
end of a pty (as it runs on a virtio-serial port in a guest), the host's
AgentChannel on the other, and the unchanged exec client on the control
path. Concurrent requests share the one stream; a channel that breaks ends
its requests instead of hanging them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import tty
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from corral.errors import FileNotFound
from corral.execd import protocol as p
from corral.execd.client import ExecdClient
from corral.runtimes.vm.channel import AgentChannel, Port

INIT = Path(__file__).resolve().parents[2] / "build" / "platform" / "bin" / "corral-init"


async def _pty_port(master: int) -> Port:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=4 * p.MAX_PAYLOAD)
    await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader),
        os.fdopen(os.dup(master), "rb", buffering=0),
    )
    transport, protocol = await loop.connect_write_pipe(
        asyncio.streams.FlowControlMixin, os.fdopen(os.dup(master), "wb", buffering=0)
    )
    return reader, asyncio.StreamWriter(transport, protocol, reader, loop)


class Guest:
    """corral-init on the slave side of a pty: a guest's agent on its port."""

    def __init__(self) -> None:
        self.master, self.slave = os.openpty()
        tty.setraw(self.slave)
        self.path = os.ttyname(self.slave)
        self.proc = subprocess.Popen([str(INIT), "--serial", self.path])

    def vanish(self) -> None:
        """The guest and its port go away (QEMU exited)."""
        subprocess.run(["pkill", "-KILL", "-f", f"corral-init --serial {self.path}"])
        self.proc.wait(10)
        if self.slave >= 0:
            os.close(self.slave)
            self.slave = -1


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[tuple[ExecdClient, Guest]]:
    if not INIT.exists():
        pytest.fail(f"{INIT} is missing: run `make -C native`")
    guest = Guest()
    channel = AgentChannel(tmp_path / "agent.sock", lambda: _pty_port(guest.master))
    await channel.start()
    try:
        yield ExecdClient(str(tmp_path / "agent.sock")), guest
    finally:
        await channel.aclose()
        guest.vanish()
        os.close(guest.master)


async def _run(client: ExecdClient, argv: list[str], stdin: bytes | None = None) -> bytes:
    session = await client.start(
        argv, ["PATH=/usr/bin:/bin"], user="root", cwd="/", timeout=30,
        stdout_cap=8 << 20, stderr_cap=1 << 20, stdin=stdin,
    )  # fmt: skip
    out = b""
    async for kind, data in session.events():
        if kind == p.RSP_STDOUT:
            out += data
    return out


async def test_requests_share_one_serial_stream(
    agent: tuple[ExecdClient, Guest], tmp_path: Path
) -> None:
    client, _guest = agent
    async with asyncio.timeout(10):
        version, _pid = await client.ping()
    assert version == p.VERSION
    # Sixteen commands at once, each its own stream, none mixed up.
    outs = await asyncio.gather(*(_run(client, ["echo", f"stream-{i}"]) for i in range(16)))
    assert outs == [f"stream-{i}\n".encode() for i in range(16)]
    # Large output and input cross as many frames.
    big = await _run(client, ["head", "-c", str(3 << 20), "/dev/zero"])
    assert big == bytes(3 << 20)
    echoed = await _run(client, ["cat"], stdin=os.urandom(1 << 20))
    assert len(echoed) == 1 << 20
    # Files, through the same requests as a container's.
    target = tmp_path / "f.txt"
    await client.write("root", str(target), b"over the serial port", max_bytes=1 << 20)
    assert await client.read("root", str(target), 1 << 20) == b"over the serial port"
    assert target.read_bytes() == b"over the serial port"


async def test_a_broken_channel_ends_requests_instead_of_hanging_them(
    agent: tuple[ExecdClient, Guest],
) -> None:
    client, guest = agent
    async with asyncio.timeout(10):
        await client.ping()
    session = await client.start(
        ["sleep", "60"], [], user="root", cwd="/", timeout=None,
        stdout_cap=1024, stderr_cap=1024, stdin=None,
    )  # fmt: skip
    guest.vanish()

    async def drain() -> None:
        async for _ in session.events():
            pass

    try:
        with pytest.raises(ConnectionError):
            async with asyncio.timeout(10):
                await drain()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(session.pid, 9)  # orphaned by the dead agent


async def test_thousands_of_short_requests_leave_the_guest_nothing(
    agent: tuple[ExecdClient, Guest],
) -> None:
    """Each request is a stream both ends close; a stream the guest has
    ended must still be closed by the host, or the guest's multiplexer keeps
    its descriptor and, past its 1024 open files, refuses every new stream."""
    client, guest = agent
    for _ in range(1500):
        with pytest.raises(FileNotFound):
            await client.stat("root", "/nonexistent/corral")
    await client.ping()
    mux = [
        int(pid)
        for pid in subprocess.run(
            ["pgrep", "-f", f"corral-init --serial {guest.path}"], capture_output=True, text=True
        ).stdout.split()
    ]
    # The multiplexer and PID 1: a handful of descriptors each, not thousands.
    assert mux and all(len(os.listdir(f"/proc/{pid}/fd")) < 32 for pid in mux)
