"""The own-disk guest's DHCP server (guard/dhcp.py) against a real client
(busybox's udhcpc) across a real veth, and against a flood: each in a
network namespace of its own, as a VM's bridge would be."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.guard.dhcp import RATE, Lease, Responder

HOST_MAC = "02:c0:00:00:00:7f"
SCRIPT = '#!/bin/sh\necho "$1 ip=$ip mask=$subnet router=$router dns=$dns lease=$lease"\n'
# A guest that floods DISCOVERs as fast as it can write them.
FLOOD = """
import socket, struct, sys
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
s.bind((sys.argv[1], 0))
msg = struct.pack("!BBBB4sHH16s16s", 1, 1, 6, 0, b"flud", 0, 0, bytes(16), b"\\x52" * 6 + bytes(10))
msg += bytes(192) + b"\\x63\\x82\\x53\\x63" + bytes([53, 1, 1, 255])
udp = struct.pack("!HHHH", 68, 67, 8 + len(msg), 0) + msg
ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0, bytes(4), b"\\xff" * 4)
frame = b"\\xff" * 6 + b"\\x52" * 6 + b"\\x08\\x00" + ip + udp
for _ in range(int(sys.argv[2])):
    s.send(frame)
"""


def _sh(cmd: str) -> None:
    subprocess.run(cmd, shell=True, check=True, capture_output=True)


@pytest.fixture
def link() -> Iterator[tuple[str, str, str]]:
    """(host end, guest end, the guest's namespace): a veth whose guest end
    is in a namespace of its own."""
    if shutil.which("busybox") is None:
        pytest.skip("requires busybox (udhcpc): apt install busybox-static")
    tag = uuid.uuid4().hex[:6]
    ns, host, guest = f"dhcp{tag}", f"dh{tag}", f"dg{tag}"
    _sh(f"ip netns add {ns}")
    try:
        _sh(f"ip link add {host} address {HOST_MAC} type veth peer name {guest}")
        _sh(f"ip link set {guest} netns {ns} && ip link set {host} up && "
            f"ip netns exec {ns} ip link set {guest} up")  # fmt: skip
        yield host, guest, ns
    finally:
        subprocess.run(["ip", "link", "del", host], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


async def test_udhcpc_gets_the_lease(link: tuple[str, str, str], tmp_path: Path) -> None:
    host, guest, ns = link
    script = tmp_path / "udhcpc.sh"
    script.write_text(SCRIPT)
    script.chmod(0o755)
    server = Responder("t", host, Lease("10.200.9.2", "10.200.9.1"), HOST_MAC)
    server.start()
    try:
        proc = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", ns, "busybox", "udhcpc", "-i", guest, "-n", "-q", "-f",
            "-t", "5", "-T", "1", "-s", str(script),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        async with asyncio.timeout(30):
            out, _ = await proc.communicate()
    finally:
        await asyncio.to_thread(server.close)  # as a release does, from a worker thread
    await asyncio.sleep(0)
    assert server.sock.fileno() == -1
    text = out.decode()
    assert proc.returncode == 0, text
    assert "bound ip=10.200.9.2 mask=255.255.255.252 router=10.200.9.1 dns=10.200.9.1" in text
    assert "lease=3600" in text
    assert server.answered == 2  # the OFFER and the ACK


async def test_a_flood_of_discovers_gets_a_bounded_number_of_answers(
    link: tuple[str, str, str],
) -> None:
    host, guest, ns = link
    server = Responder("t", host, Lease("10.200.9.2", "10.200.9.1"), HOST_MAC)
    server.start()
    try:
        proc = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", ns, sys.executable, "-c", FLOOD, guest, "2000"
        )  # fmt: skip
        async with asyncio.timeout(60):
            assert await proc.wait() == 0
        await asyncio.sleep(1.0)  # the loop drains what the kernel queued
    finally:
        server.close()
    # At most a burst and a second's refill went out, however many came.
    assert 0 < server.answered <= 3 * RATE, (server.answered, server.dropped)
    assert server.dropped > 0


async def test_the_server_closes_itself_when_its_veth_goes(link: tuple[str, str, str]) -> None:
    """A VM's QEMU ends (suspend to disk, a guest that powers off): its
    veth goes, and the server closes and tells its owner, once."""
    host, _, _ = link
    gone: list[Responder] = []
    told = asyncio.Event()

    def on_gone(r: Responder) -> None:
        gone.append(r)
        told.set()

    server = Responder("t", host, Lease("10.200.9.2", "10.200.9.1"), HOST_MAC, on_gone=on_gone)
    server.start()
    try:
        _sh(f"ip link del {host}")
        async with asyncio.timeout(10):
            await told.wait()
        await asyncio.sleep(0.2)
        assert gone == [server] and server.sock.fileno() == -1
    finally:
        server.close()
