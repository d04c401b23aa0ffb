"""Crash recovery: kill -9 the agent with sandboxes alive; restart; nothing
lost, nothing leaked. And `corral gc` by hand."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from pathlib import Path

import pytest

import corral
from corral.config import NodeConfig
from corral.guard.seccompd import SeccompDaemon
from corral.host import mounts

from ..framework import IMAGE, Node


async def test_kill_9_with_50_sandboxes_then_restart(fresh_node: Node) -> None:
    srv = fresh_node.server
    srv.start()
    async with fresh_node.http_client() as c:
        boxes = await asyncio.gather(
            *(
                c.sandboxes.create(image=IMAGE, memory="64MiB", labels={"n": str(i)})
                for i in range(50)
            )
        )
        await asyncio.gather(*(b.files.write("/state", f"box {i}") for i, b in enumerate(boxes)))
    srv.kill(signal.SIGKILL)
    assert len(fresh_node.init_processes()) == 50  # the sandboxes outlive their agent
    assert len(fresh_node.records()) == 50

    srv.start()
    async with fresh_node.http_client() as c:
        alive = await c.sandboxes.list()
        assert sorted(s.id for s in alive) == sorted(b.id for b in boxes)
        texts = await asyncio.gather(*(c.sandboxes.get(b.id) for b in boxes))
        reads = await asyncio.gather(*(s.files.read_text("/state") for s in texts))
        assert reads == [f"box {i}" for i in range(50)]
        r = await texts[7].commands.run("echo still here")
        assert r.stdout == "still here\n"
        await asyncio.gather(*(s.close() for s in texts))
    srv.stop()
    assert fresh_node.leftovers() == {}
    assert fresh_node.mounts() == []


async def test_kill_9_in_the_middle_of_creates(fresh_node: Node) -> None:
    srv = fresh_node.server
    srv.start()
    async with fresh_node.http_client() as c:
        tasks = [
            asyncio.create_task(c.sandboxes.create(image=IMAGE, memory="64MiB")) for _ in range(20)
        ]
        await asyncio.sleep(0.25)
        srv.kill(signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    made = [r for r in results if isinstance(r, corral.AsyncSandbox)]
    failed = [r for r in results if isinstance(r, BaseException)]
    assert all(isinstance(e, corral.CorralError) for e in failed), failed
    srv.start()
    async with fresh_node.http_client() as c:
        alive = {s.id for s in await c.sandboxes.list()}
        # Finished creates survive; half-made ones were unwound on restart.
        assert {m.id for m in made} <= alive
        for s in await c.sandboxes.list():
            assert (await s.commands.run("echo ok")).stdout == "ok\n"
            await s.close()
    srv.stop()
    assert fresh_node.leftovers() == {}


async def test_gc_reclaims_what_a_crash_left(fresh_node: Node) -> None:
    audit = fresh_node.config.data_dir / "audit"
    async with fresh_node.client() as c:
        sbx = await c.sandboxes.create(image=IMAGE)
        keep = await c.sandboxes.create(image=IMAGE)
        # Refused a mount: its counts file, made by the first count, is kept.
        await keep.commands.run(
            "python3 -c 'import ctypes; ctypes.CDLL(None).syscall(165, 0, 0, 0, 0, 0)'"
        )
        # What an older Corral left at every close: the seccomp daemon's
        # counts of a closed sandbox (folded into its records by gc) ...
        closed = await c.sandboxes.create(image=IMAGE)
        await closed.close()
        slots = bytearray(8 * 1024)
        slots[8 * 165 : 8 * 166] = (4).to_bytes(8, "little")  # mount, refused 4 times
        (audit / f"{closed.id}.seccomp").write_bytes(bytes(slots))
        # ... and of one whose record is gone (purged), with another node's.
        (audit / f"{fresh_node.config.node}-0123456789abcdef.seccomp").write_bytes(bytes(slots))
        (audit / "elsewhere-0123456789abcdef.seccomp").write_bytes(bytes(slots))
        # The aftermath of a crash: the record is gone, the resources are not.
        held = {kind for kind, _ref in fresh_node.forget(sbx.id)}
        assert {"container", "subvolume"} <= held, held
        assert fresh_node.record(sbx.id) is None
        assert len(fresh_node.init_processes()) == 2
    out = fresh_node.cli("--json", "gc", timeout=60)
    report = json.loads(out.stdout)
    assert report["reclaimed"].get("container", 0) >= 1
    assert report["reclaimed"].get("subvolume", 0) == 1
    assert len(fresh_node.init_processes()) == 1
    assert sorted(p.name for p in audit.glob("*.seccomp")) == sorted(
        [f"{keep.id}.seccomp", "elsewhere-0123456789abcdef.seccomp"]
    )
    (audit / "elsewhere-0123456789abcdef.seccomp").unlink()
    async with fresh_node.client() as c:
        assert (await (await c.sandboxes.get(closed.id)).audit()).syscalls == {"mount": 4}
        s = await c.sandboxes.get(keep.id)
        assert (await s.commands.run("echo kept")).stdout == "kept\n"
        await s.close()
    await asyncio.sleep(0.1)
    assert fresh_node.leftovers() == {}


async def test_a_start_that_fails_leaves_no_daemon_and_no_mount(fresh_config: NodeConfig) -> None:
    # The node's records cannot be opened (a directory where state.db goes;
    # a full disk fails the same step): the agent started its seccomp
    # daemon and mounted its scratch pool before it got there.
    fresh_config.db_path.mkdir(parents=True)
    with pytest.raises(corral.Unavailable, match=r"state\.db"):
        async with corral.AsyncClient(config=fresh_config) as c:
            await c.sandboxes.list()
    assert SeccompDaemon(fresh_config.data_dir, Path("/nonexistent")).running_pid() is None
    assert mounts.mounts_under(fresh_config.data_dir) == []
    # Once the way is clear the node starts as if nothing had happened.
    fresh_config.db_path.rmdir()
    async with corral.AsyncClient(config=fresh_config) as c:
        s = await c.sandboxes.create(image=IMAGE)
        assert (await s.commands.run("echo up")).stdout == "up\n"
        await s.close()
    assert SeccompDaemon(fresh_config.data_dir, Path("/nonexistent")).running_pid() is None
    assert mounts.mounts_under(fresh_config.data_dir) == []


async def test_the_last_agent_out_removes_the_nodes_network_table(fresh_node: Node) -> None:
    table = f"corral_{fresh_node.config.node}"

    def present() -> bool:
        return (
            subprocess.run(["nft", "list", "table", "inet", table], capture_output=True).returncode
            == 0
        )

    async with fresh_node.client() as c:
        sbx = await c.sandboxes.create(image=IMAGE, network={"cidrs": ["10.9.8.7/32"]})
        assert present()
        await sbx.close()
    assert not present()
    assert fresh_node.leftovers() == {}
