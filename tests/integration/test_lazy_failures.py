"""Lazy loading when things go wrong: the store down or slow, a corrupt
chunk, the loader killed; and the chunk cache surviving an agent restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import corral
from corral.config import NodeConfig
from corral.images import registry
from corral.images.lazy.loader import LazyLoader
from corral.images.mounter import LayerMounts
from corral.images.objects import HttpObjects, open_store
from corral.images.store import ImageStore
from corral.runtimes.container import criu
from corral.runtimes.vm.runtime import MicroVMRuntime

from ..framework import IMAGE, Blobd, Node, agent_of

BIG = "/usr/lib/python3.11/pydoc_data/topics.py"  # ~700 KB nobody reads at start


def _noprogress(task: str, done: float, total: float | None) -> None:
    pass


@pytest.fixture
def pulled_node(node_config: NodeConfig, fresh_node: Node, blobd: Blobd) -> Node:
    """A node whose only image was pulled from the HTTP store (cold cache)."""
    registry.push(ImageStore(node_config.images_dir), IMAGE, HttpObjects(blobd.url), _noprogress)
    node = fresh_node.with_config(
        images=fresh_node.config.data_dir / "images", lazy_deadline=2.0, liveness_interval=0.3
    )
    registry.pull(ImageStore(node.config.images_dir), IMAGE, open_store(blobd.url), _noprogress)
    return node


@pytest.fixture
async def lazy_client(pulled_node: Node) -> AsyncIterator[corral.AsyncClient]:
    async with pulled_node.client() as c:
        yield c
        for s in await c.sandboxes.list():
            await s.close()


def _stats(node: Node) -> dict[str, Any]:
    """The lazy loader's counters of the node's one layer (it writes them
    while it runs)."""
    doc = json.loads((node.config.data_dir / "lazy" / "fs" / ".stats").read_bytes())
    (layer,) = doc["layers"].values()
    return dict(layer)


async def test_store_down_fails_only_the_reads_that_need_it(
    lazy_client: corral.AsyncClient, pulled_node: Node, blobd: Blobd
) -> None:
    a = await lazy_client.sandboxes.create(image=IMAGE)
    assert (await a.commands.run("python3 -c 'print(1)'")).stdout == "1\n"
    blobd.kill()
    t0 = time.monotonic()
    r = await a.commands.run(f"cat {BIG} > /dev/null", timeout=60)
    assert time.monotonic() - t0 < 15  # bounded by the read deadline, not hung
    assert r.exit_code != 0 and "Input/output error" in r.stderr
    # What was already read still works, in this sandbox and a new one.
    assert (await a.commands.run("python3 -c 'print(2)'")).stdout == "2\n"
    b = await lazy_client.sandboxes.create(image=IMAGE)
    assert (await b.commands.run("echo fine")).stdout == "fine\n"
    assert _stats(pulled_node)["failed_reads"] >= 1
    blobd.start()
    await asyncio.sleep(2 * pulled_node.config.lazy_deadline)  # the loader fails fast meanwhile
    r = await a.commands.run(f"wc -c < {BIG}", timeout=60)
    assert r.exit_code == 0 and int(r.stdout) > 100_000


async def test_a_slow_store_costs_bounded_time(pulled_node: Node, blobd: Blobd) -> None:
    async with pulled_node.client() as client:
        sbx = await client.sandboxes.create(image=IMAGE)
        await sbx.commands.run("true")
        blobd.kill()
        slow = Blobd(blobd.root, rate="20KB", port=blobd.port)
        slow.start()
        try:
            t0 = time.monotonic()
            r = await sbx.commands.run(f"cat {BIG} > /dev/null", timeout=60)
            assert time.monotonic() - t0 < 5 * pulled_node.config.lazy_deadline
            assert r.exit_code != 0 and "Input/output error" in r.stderr
            assert (await sbx.commands.run("echo responsive")).stdout == "responsive\n"
        finally:
            slow.kill()
        await sbx.close()


async def test_a_corrupt_cached_chunk_is_refetched_and_reported(
    lazy_client: corral.AsyncClient, pulled_node: Node
) -> None:
    sbx = await lazy_client.sandboxes.create(image=IMAGE)
    want = (await sbx.commands.run(f"md5sum {BIG}")).stdout
    cache = pulled_node.config.data_dir / "cache" / "chunks"
    (data,) = cache.glob("*.data")
    # Rot every cached byte of the file's chunks, then make the kernel forget
    # its copies so the next read reaches the loader.
    raw = bytearray(data.read_bytes())
    for i in range(0, len(raw), 4096):
        raw[i] ^= 0xFF
    data.write_bytes(bytes(raw))
    Path("/proc/sys/vm/drop_caches").write_text("3")
    got = (await sbx.commands.run(f"md5sum {BIG}")).stdout
    assert got == want
    assert _stats(pulled_node)["corrupt_chunks"] > 0


async def _failed_for_the_loader(sbx: corral.AsyncSandbox) -> None:
    """It is failed, with the loader named (polled: the leader checks every
    liveness_interval)."""
    for _ in range(200):
        if (await sbx.refresh()).state == corral.SandboxState.failed:
            break
        await asyncio.sleep(0.1)
    assert sbx.info.state == corral.SandboxState.failed
    assert "loader" in (sbx.info.error or "")


async def test_a_killed_loader_fails_its_sandboxes_and_is_replaced(
    lazy_client: corral.AsyncClient, pulled_node: Node
) -> None:
    sbx = await lazy_client.sandboxes.create(image=IMAGE)
    await sbx.commands.run("true")
    pid = int((pulled_node.config.data_dir / "lazy.lock").read_text())
    os.kill(pid, signal.SIGKILL)
    await _failed_for_the_loader(sbx)
    fresh = await lazy_client.sandboxes.create(image=IMAGE)
    assert (await fresh.commands.run("python3 -c 'print(3)'")).stdout == "3\n"
    await fresh.close()


async def test_a_loader_a_create_replaced_first_still_fails_its_sandboxes(
    pulled_node: Node,
) -> None:
    """A create that finds the loader dead clears its mounts and starts a
    new one: the sandboxes that read through the dead one are failed all
    the same (before, the leader then found a live loader and failed none:
    they ran on, every read answering EIO), and the create's own runs."""
    node = pulled_node.with_config(liveness_interval=3.0)  # the create comes first
    async with node.client() as c:
        old = await c.sandboxes.create(image=IMAGE)
        await old.commands.run("true")
        cfg = node.config
        loader = LazyLoader(cfg.data_dir, cfg.images_dir, cache_size=cfg.chunk_cache_size)
        os.kill(loader.running_pid() or 0, signal.SIGKILL)
        for _ in range(100):
            if loader.running_pid() is None:
                break
            await asyncio.sleep(0.02)
        new = await c.sandboxes.create(image=IMAGE)
        await _failed_for_the_loader(old)
        assert (await new.refresh()).state == corral.SandboxState.running
        assert (await new.commands.run(f"wc -c < {BIG}")).stdout.strip().isdigit()
        await new.close()
        await old.close()


def _loader_replaced(node: Node) -> None:
    """Kill the node's loader and wait (blocking) until the leader has
    cleared its mounts (the epoch moved on)."""
    mounts = LayerMounts(ImageStore(node.config.images_dir), node.config.mounts_dir)
    before = mounts.epoch()
    os.kill(int((node.config.data_dir / "lazy.lock").read_text()), signal.SIGKILL)
    for _ in range(300):
        if mounts.epoch() > before:
            return
        time.sleep(0.05)
    raise AssertionError("the leader never cleared the dead loader's mounts")


@pytest.mark.requires_qemu
async def test_a_vm_whose_loader_died_before_its_qemu_started_reads_through_the_next(
    lazy_client: corral.AsyncClient, pulled_node: Node
) -> None:
    """The loader dies after the create mounted the VM's layers and before
    QEMU opens its lazy devices (here: while the runtime looks up its guest
    kernel). The VM starts through a new loader and is stamped with it, so
    the leader does not fail it (before, QEMU found the devices gone with
    the cleared mounts)."""
    runtime = agent_of(lazy_client).parts.runtimes["microvm"]
    assert isinstance(runtime, MicroVMRuntime)
    real = runtime.artefacts
    calls = 0

    def artefacts() -> Any:  # called off the loop, before QEMU starts
        nonlocal calls
        calls += 1
        if calls == 1:
            _loader_replaced(pulled_node)
        return real()

    runtime.artefacts = artefacts  # type: ignore[method-assign]  # a test's hook
    try:
        vm = await lazy_client.sandboxes.create(kind="microvm", image=IMAGE, memory="256MiB")
    finally:
        del runtime.artefacts
    try:
        assert calls >= 1
        r = await vm.commands.run(f"wc -c < {BIG}")
        assert r.exit_code == 0 and int(r.stdout) > 100_000, r
        await asyncio.sleep(3 * pulled_node.config.liveness_interval)  # the leader's checks
        assert (await vm.refresh()).state == corral.SandboxState.running
    finally:
        await vm.close()


async def test_a_sandbox_suspended_to_disk_when_its_loader_dies_resumes_through_the_next(
    lazy_client: corral.AsyncClient, pulled_node: Node
) -> None:
    """Its restored processes open its layers again, mounted again through
    a new loader; it is stamped with that loader's epoch, so the leader
    does not fail it later. One frozen then still holds the dead loader's
    files: its resume fails it, saying so, instead of running it on with
    every read failing (the leader fails running sandboxes only)."""
    if criu.available() is not None:
        pytest.fail(f"container checkpoints need CRIU: {criu.available()}")
    on_disk = await lazy_client.sandboxes.create(image=IMAGE)
    frozen = await lazy_client.sandboxes.create(image=IMAGE)
    try:
        for sbx in (on_disk, frozen):
            await sbx.commands.run("true")
        await on_disk.suspend("disk")
        await frozen.suspend("freeze")
        await asyncio.to_thread(_loader_replaced, pulled_node)
        assert (await on_disk.resume()).state == corral.SandboxState.running
        r = await on_disk.commands.run(f"wc -c < {BIG}")
        assert r.exit_code == 0 and int(r.stdout) > 100_000, r
        with pytest.raises(corral.SandboxFailed, match="loader"):
            await frozen.resume()
        assert (await frozen.refresh()).state == corral.SandboxState.failed
        assert "loader" in (frozen.info.error or "")
        await asyncio.sleep(3 * pulled_node.config.liveness_interval)  # the leader's checks
        assert (await on_disk.refresh()).state == corral.SandboxState.running
        assert (await on_disk.commands.run("python3 -c 'print(3)'")).stdout == "3\n"
    finally:
        await asyncio.gather(on_disk.close(), frozen.close(), return_exceptions=True)


@contextlib.asynccontextmanager
async def _loader_stopped(node: Node) -> AsyncIterator[int]:
    """The node's lazy loader stopped (SIGSTOP: it holds its lock and
    answers nothing) for the block; its pid."""
    pid = int((node.config.data_dir / "lazy.lock").read_text())
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


async def test_a_silent_loader_is_waited_for_not_condemned(pulled_node: Node) -> None:
    """A loader that holds its lock but answers nothing (stopped here; slow
    on a busy host or an emulated CPU) for less than lazy_hang_timeout is
    not dead: its sandboxes run on, and the next create reads through it."""
    node = pulled_node.with_config(lazy_hang_timeout=60.0)
    async with node.client() as c:
        sbx = await c.sandboxes.create(image=IMAGE)
        await sbx.commands.run("true")
        async with _loader_stopped(node) as pid:
            # Several liveness checks (0.3 s apart), each given 2 s to answer.
            await asyncio.sleep(5)
        assert (await sbx.refresh()).state == corral.SandboxState.running
        assert (await sbx.commands.run("python3 -c 'print(3)'")).stdout == "3\n"
        other = await c.sandboxes.create(image=IMAGE)
        assert (await other.commands.run(f"wc -c < {BIG}")).stdout.strip().isdigit()
        assert int((node.config.data_dir / "lazy.lock").read_text()) == pid
        await other.close()
        await sbx.close()


async def test_a_loader_silent_past_the_hang_timeout_is_killed_and_replaced(
    pulled_node: Node,
) -> None:
    node = pulled_node.with_config(lazy_hang_timeout=2.0)
    async with node.client() as c:
        sbx = await c.sandboxes.create(image=IMAGE)
        await sbx.commands.run("true")
        async with _loader_stopped(node) as pid:
            await _failed_for_the_loader(sbx)
        assert (
            not Path(f"/proc/{pid}/status").exists()
            or "zombie" in Path(f"/proc/{pid}/status").read_text()
        )
        fresh = await c.sandboxes.create(image=IMAGE)
        assert (await fresh.commands.run("python3 -c 'print(3)'")).stdout == "3\n"
        await fresh.close()


def test_mounts_left_by_a_killed_loader_are_replaced_at_next_use(pulled_node: Node) -> None:
    """An agent and its loader both killed (a crashed `corral serve`, a
    killed CI run) leave the FUSE mount and the layer mounts reading through
    it: the next process to use the layer must not be handed them (every
    exec from them fails with EIO)."""
    cfg = pulled_node.config
    store = ImageStore(cfg.images_dir)
    layer = store.resolve(IMAGE)

    def loader() -> LazyLoader:
        return LazyLoader(cfg.data_dir, cfg.images_dir, cache_size=cfg.chunk_cache_size)

    first = LayerMounts(store, cfg.mounts_dir, loader())
    path = first.ensure(layer)
    assert (path / "usr/bin/python3").stat().st_size > 0
    pid = int((cfg.data_dir / "lazy.lock").read_text())
    os.kill(pid, signal.SIGKILL)
    for _ in range(100):
        if loader().running_pid() is None:
            break
        time.sleep(0.05)
    Path("/proc/sys/vm/drop_caches").write_text("3")
    with pytest.raises(OSError):
        (path / BIG.lstrip("/")).read_bytes()  # what the next sandbox would get
    again = LayerMounts(store, cfg.mounts_dir, loader())
    path = again.ensure(layer)
    assert len((path / BIG.lstrip("/")).read_bytes()) > 100_000
    again.release_all()


async def test_the_chunk_cache_survives_an_agent_restart(pulled_node: Node) -> None:
    async with pulled_node.client() as c:
        sbx = await c.sandboxes.create(image=IMAGE)
        await sbx.commands.run(f"cat {BIG} > /dev/null")
        first = _stats(pulled_node)["fetched_bytes"]
        await sbx.close()
    assert not (
        pulled_node.config.data_dir / "lazy" / "fs" / ".stats"
    ).exists()  # the loader stopped
    async with pulled_node.client() as c:
        sbx = await c.sandboxes.create(image=IMAGE)
        # The same reader as before: its own chunks (cat's) are cached too.
        r = await sbx.commands.run(f"cat {BIG} > /dev/null")
        assert r.exit_code == 0
        assert _stats(pulled_node)["fetched_bytes"] < first // 10  # served by the cache
        await sbx.close()
    assert pulled_node.leftovers() == {}
