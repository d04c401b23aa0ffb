"""Copies of a networked sandbox (docs/network-copies.md): what giving each
copy its own address costs.

    corral bench network_copies [--n 10]

Side by side and interleaved, each with and without a network (the peer:
the same operation on a sandbox with none): a container holding 50 MiB
forked into 2 copies (its interface unplugged for the dump and plugged
back; each copy's connections out aborted and its new interface made); the
same container saved and restored on a second node of this machine; a
microVM (256 MiB guest) forked into 1 copy (its guest re-addressed through
its agent). The networked sandboxes each hold 20 connections out (to a
listener in a network namespace of the bench's own) and 20 over loopback
when they are copied.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corral
from _common import IMAGE, IMAGES, median, pct, table, write_result
from corral.config import NodeConfig

DATA = Path("/var/lib/corral-netcopies")
PEER_NS, PEER_IP, PEER_HOST_IP = "cnc-peer", "10.214.0.2", "10.214.0.1"
POLICY = {"cidrs": [f"{PEER_IP}/32"], "ports": [9000]}
# 50 MiB resident, and (with an address given) 20 connections out and 20
# over loopback, held until the sandbox ends.
HOLD = """
import os, socket, sys, time
x = bytearray(50 << 20)
for i in range(0, len(x), 4096):
    x[i] = 1
held = []
if len(sys.argv) > 1:
    server = socket.socket()
    server.bind(("127.0.0.1", 7000))
    server.listen(64)
    for _ in range(20):
        held.append(socket.create_connection((sys.argv[1], 9000), timeout=5))
        held.append(socket.create_connection(("127.0.0.1", 7000)))
        held.append(server.accept()[0])
open("/tmp/held.new", "w").write(str(len(held)))
os.replace("/tmp/held.new", "/tmp/held")
time.sleep(100000)
"""
LISTEN = (
    f"PEER_IP = {PEER_IP!r}\n"
    """
import socket, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((PEER_IP, 9000))
s.listen(1024)
held = []
while True:
    held.append(s.accept()[0])
"""
)


WHERE = """## What a network adds

To a container's fork: its interface unplugged before the dump and plugged
back after it (a veth deleted, made again and moved into its namespace,
~50 ms together, the dump waiting), the dump and restore of its 40 TCP
connections, and for each copy (concurrently) its connections out aborted
(corral-netmove, ~5 ms) and a veth, an address, a route and the policy's
chain made for it (~50 ms). To a microVM's fork: the copy's veth, and its
guest re-addressed through its agent (one shell of six busybox commands,
under TCG)."""


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def peer_up() -> subprocess.Popen[bytes]:
    """A listener in a namespace of its own, routed from the host."""
    peer_down()
    _sh("ip", "netns", "add", PEER_NS)
    _sh("ip", "link", "add", "cnch", "type", "veth", "peer", "name", "cncn", "netns", PEER_NS)
    _sh("ip", "addr", "add", f"{PEER_HOST_IP}/24", "dev", "cnch")
    _sh("ip", "link", "set", "cnch", "up")
    for cmd in (["addr", "add", f"{PEER_IP}/24", "dev", "cncn"], ["link", "set", "cncn", "up"],
                ["route", "add", "default", "via", PEER_HOST_IP]):  # fmt: skip
        _sh("ip", "-n", PEER_NS, *cmd)
    return subprocess.Popen(["ip", "netns", "exec", PEER_NS, sys.executable, "-c", LISTEN])


def peer_down() -> None:
    subprocess.run(["ip", "link", "del", "cnch"], capture_output=True)
    subprocess.run(["ip", "netns", "del", PEER_NS], capture_output=True)


def config(node: str) -> NodeConfig:
    cfg = NodeConfig.from_env(data_dir=DATA / node, images=IMAGES, node=node, memory_overcommit=8.0)
    return replace(cfg, network_pool="10.203.0.0/16" if node == "ncb" else cfg.network_pool,
                   dns_port=cfg.dns_port + (1 if node == "ncb" else 0))  # fmt: skip


async def holding(c: corral.AsyncClient, kind: str, networked: bool) -> corral.AsyncSandbox:
    spec: dict[str, object] = {"image": IMAGE, "memory": "256MiB", "kind": kind}
    if networked:
        spec["network"] = POLICY
    sbx = await c.sandboxes.create(**spec)  # type: ignore[arg-type]
    await sbx.files.write("/tmp/hold.py", HOLD)
    arg = PEER_IP if networked else ""
    await sbx.commands.run(f"nohup python3 /tmp/hold.py {arg} >/tmp/hold.log 2>&1 &")
    deadline = time.monotonic() + 120
    while True:
        try:
            held = await sbx.files.read_text("/tmp/held")
            assert held == ("60" if networked else "0"), held
            return sbx
        except corral.FileNotFound:
            assert time.monotonic() < deadline, await sbx.files.read_text("/tmp/hold.log")
            await asyncio.sleep(0.1)


def row(name: str, times: list[float], base: list[float]) -> list[str]:
    return [name, f"{median(times) * 1000:.1f}", f"{pct(times, 99) * 1000:.1f}",
            f"{median(times) / median(base):.2f}x"]  # fmt: skip


async def interleaved(
    n: int, ops: dict[str, Callable[[], Awaitable[None]]]
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(n):
        for name, op in ops.items():
            t0 = time.perf_counter()
            await op()
            times[name].append(time.perf_counter() - t0)
    return times


async def main(n: int) -> None:
    listener = peer_up()
    try:
        async with corral.AsyncClient(config=config("nca")) as c, \
                corral.AsyncClient(config=config("ncb")) as other:  # fmt: skip
            sections: list[str] = []
            try:
                plain = await holding(c, "container", False)
                net = await holding(c, "container", True)
                kept: list[corral.AsyncSandbox] = []

                def fork(src: corral.AsyncSandbox, k: int) -> Callable[[], Awaitable[None]]:
                    async def op() -> None:
                        kept.extend(await c.sandboxes.fork(src, k))

                    return op

                def move(src: corral.AsyncSandbox) -> Callable[[], Awaitable[None]]:
                    async def op() -> None:
                        kept.append(await other.sandboxes.restore(await src.save()))

                    return op

                async def tidy() -> None:
                    await asyncio.gather(*(x.close() for x in kept))
                    kept.clear()
                    for s in (plain, net):
                        await s.resume()

                forks: dict[str, list[float]] = {"none": [], "net": []}
                moves: dict[str, list[float]] = {"none": [], "net": []}
                for _ in range(n):
                    t = await interleaved(1, {"none": fork(plain, 2), "net": fork(net, 2)})
                    t2 = await interleaved(1, {"none": move(plain), "net": move(net)})
                    for k in forks:
                        forks[k] += t[k]
                        moves[k] += t2[k]
                    await tidy()
                await asyncio.gather(plain.close(), net.close())
                header = ["what", "p50 (ms)", "p99 (ms)", "p50 vs no network"]
                sections.append(
                    f"## A container holding 50 MiB, {n} times each, interleaved\n\n"
                    + table(
                        header,
                        [
                            row("fork into 2 copies, no network", forks["none"], forks["none"]),
                            row(
                                "fork into 2 copies, networked (20 connections out, 20 loopback)",
                                forks["net"],
                                forks["none"],
                            ),
                            row(
                                "save, then restore on another node, no network",
                                moves["none"],
                                moves["none"],
                            ),
                            row(
                                "save, then restore on another node, networked",
                                moves["net"],
                                moves["none"],
                            ),
                        ],
                    )
                )
                vm_plain = await holding(c, "microvm", False)
                vm_net = await holding(c, "microvm", True)

                async def vm_tidy() -> None:
                    await asyncio.gather(*(x.close() for x in kept))
                    kept.clear()

                vm: dict[str, list[float]] = {"none": [], "net": []}
                for _ in range(n):
                    t = await interleaved(1, {"none": fork(vm_plain, 1), "net": fork(vm_net, 1)})
                    for k in vm:
                        vm[k] += t[k]
                    await vm_tidy()
                await asyncio.gather(vm_plain.close(), vm_net.close())
                sections.append(
                    f"## A microVM (256 MiB guest, TCG), {n} times each, interleaved\n\n"
                    + table(
                        header,
                        [
                            row("fork into 1 copy, no network", vm["none"], vm["none"]),
                            row(
                                "fork into 1 copy, networked (its guest re-addressed)",
                                vm["net"],
                                vm["none"],
                            ),
                        ],
                    )
                )
            finally:  # what a failed run left, on both nodes
                for cl in (c, other):
                    left = await cl.sandboxes.list()
                    await asyncio.gather(*(x.close() for x in left), return_exceptions=True)
    finally:
        listener.kill()
        listener.wait()
        peer_down()
    sections.append(WHERE)
    path = write_result("network_copies", "Copies of a networked sandbox", sections)
    print(path.read_text())


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=10)
    asyncio.run(main(p.parse_args().n))
