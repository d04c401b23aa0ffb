"""Copies of a networked sandbox (a fork's, a restore's): each wakes up with
its source's memory, sockets and resolver caches, and must come out with
an address of its own, its source's policy, and none of its source's
connections to the outside (docs/network-copies.md)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

import corral
from corral.config import NodeConfig
from corral.runtimes.container import criu

from . import attacks as a
from .standins import Standin

POLICY = {"ecosystems": {"pypi": True}, "ports": [8080, 8081]}


async def test_a_networked_containers_copies_get_addresses_and_connections_of_their_own(
    rt_client: corral.AsyncClient, standins: dict[str, Standin]
) -> None:
    if criu.available() is not None:
        pytest.fail(f"container forks need CRIU: {criu.available()} (make install builds it)")
    index, forbidden = standins["index"], standins["forbidden"]
    src = await rt_client.sandboxes.create(image=a.IMAGE, memory="128MiB", network=POLICY)
    copies: list[corral.AsyncSandbox] = []
    try:
        # Resolved by name once: its address is learned for this sandbox only.
        assert (await a.fetch(src, "http://pypi.test:8080/answer.txt")).startswith("THE-REF")
        await src.files.write("/tmp/hold.py", a.HOLD)
        await src.commands.run(
            f"nohup python3 /tmp/hold.py {index.ip} {index.echo_port} >/tmp/hold.log 2>&1 &"
        )
        assert await a.wait_file(src, "/tmp/held") == "held"
        copies = await rt_client.sandboxes.fork(src, 2)
        addresses = [src.info.address, *(x.info.address for x in copies)]
        assert None not in addresses and len(set(addresses)) == 3, addresses
        for sbx in [src, *copies]:
            # The address it sends from is the one it was given.
            assert await a.own_address(sbx) == sbx.info.address
            await sbx.files.write("/tmp/go", "")
        # The source's connection outlived the fork (its interface was
        # unplugged for the dump and plugged back, same address); each
        # copy's was aborted, not left to hang; loopback ones were copied.
        assert await a.wait_file(src, "/tmp/result") == "outside:ping loopback:x"
        for x in copies:
            assert await a.wait_file(x, "/tmp/result") == (
                "outside:ConnectionAbortedError loopback:x"
            ), await x.files.read_text("/tmp/hold.log")
        for x in copies:
            # What its source resolved, it may reach by address (its memory
            # holds the answer); a sandbox that never asked may not.
            by_ip = await a.fetch(x, f"http://{index.ip}:8080/answer.txt")
            assert by_ip.startswith("THE-REF"), by_ip
            assert (await a.fetch(x, "http://pypi.test:8080/answer.txt")).startswith("THE-REF")
            outcome = await a.egress_to_denied(
                x, "http://answers.test:8080/answer.txt", f"{forbidden.url}/answer.txt"
            )
            assert outcome.contained, outcome.detail
            assert (await x.audit()).egress_denied > 0
        fresh = await rt_client.sandboxes.create(image=a.IMAGE, memory="64MiB", network=POLICY)
        try:
            assert (await a.fetch(fresh, f"http://{index.ip}:8080/answer.txt")).startswith(
                "blocked"
            )
        finally:
            await fresh.close()
        # The source runs on, with its policy and what it learned.
        assert (await a.fetch(src, f"http://{index.ip}:8080/answer.txt")).startswith("THE-REF")
        assert (await a.fetch(src, f"{forbidden.url}/answer.txt")).startswith("blocked")
    finally:
        await asyncio.gather(*(x.close() for x in [*copies, src]), return_exceptions=True)


@pytest.mark.parametrize(
    "kind", ["container", pytest.param("microvm", marks=pytest.mark.requires_qemu)]
)
async def test_a_networked_sandbox_restored_on_another_node_gets_that_nodes_address(
    rt_client: corral.AsyncClient, rt_config: NodeConfig, standins: dict[str, Standin], kind: str
) -> None:
    """Saved (suspended to disk; a container's interface unplugged) and
    restored on a node of its own network pool: the copy's address is
    that node's, its connections out are aborted, and the source, resumed
    here, keeps its address, its connection out, what it learned and what
    it was refused."""
    if kind == "container" and criu.available() is not None:
        pytest.fail(f"container saves need CRIU: {criu.available()} (make install builds it)")
    index, forbidden = standins["index"], standins["forbidden"]
    other = replace(
        rt_config, data_dir=rt_config.data_dir.parent / "rt2", node="rt2",
        network_pool="10.202.0.0/16", dns_port=rt_config.dns_port + 1,
    )  # fmt: skip
    src = await rt_client.sandboxes.create(
        image=a.IMAGE, kind=kind, memory="256MiB" if kind == "microvm" else "128MiB",
        network=POLICY,
    )  # fmt: skip
    try:
        assert (await a.fetch(src, "http://pypi.test:8080/answer.txt")).startswith("THE-REF")
        assert (await a.fetch(src, f"{forbidden.url}/answer.txt")).startswith("blocked")
        denied = (await src.audit()).egress_denied
        assert denied > 0
        await src.files.write("/tmp/hold.py", a.HOLD)
        await src.commands.run(
            f"nohup python3 /tmp/hold.py {index.ip} {index.echo_port} >/tmp/hold.log 2>&1 &"
        )
        assert await a.wait_file(src, "/tmp/held") == "held"
        saved = await src.save()
        async with corral.AsyncClient(config=other) as there:
            moved = await there.sandboxes.restore(saved)
            try:
                assert moved.info.address is not None
                assert moved.info.address.startswith("10.202."), moved.info.address
                assert await a.own_address(moved) == moved.info.address
                await moved.files.write("/tmp/go", "")
                assert await a.wait_file(moved, "/tmp/result") == (
                    "outside:ConnectionAbortedError loopback:x"
                )
                # Another node: what the source learned stays there.
                by_ip = await a.fetch(moved, f"http://{index.ip}:8080/answer.txt")
                assert by_ip.startswith("blocked"), by_ip
                by_name = await a.fetch(moved, "http://pypi.test:8080/answer.txt")
                assert by_name.startswith("THE-REF"), by_name
                assert (await a.fetch(moved, f"{forbidden.url}/answer.txt")).startswith("blocked")
            finally:
                await moved.close()
        assert (await src.resume()).state.value == "running"
        assert await a.own_address(src) == src.info.address
        # Its connection out was checkpointed with it and goes on (CRIU
        # binds it back to the address kept on its loopback, then the
        # interface returns with the same address).
        await src.files.write("/tmp/go", "")
        assert await a.wait_file(src, "/tmp/result") == "outside:ping loopback:x"
        # Kept through the unplug: its learned names and its counts.
        assert (await a.fetch(src, f"http://{index.ip}:8080/answer.txt")).startswith("THE-REF")
        assert (await src.audit()).egress_denied == denied
    finally:
        await src.close()
