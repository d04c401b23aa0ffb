"""Crash recovery: kill -9 the agent with sandboxes alive; restart; nothing
lost, nothing leaked. And `corral gc` by hand."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import corral
from corral.config import NodeConfig
from corral.host import mounts

from ..support import IMAGE, Server, init_processes, node_leftovers


async def test_kill_9_with_50_sandboxes_then_restart(
    fresh_config: NodeConfig, data_root: Path
) -> None:
    srv = Server(fresh_config, data_root / f"{fresh_config.node}.sock")
    srv.start()
    try:
        async with corral.AsyncClient(srv.url) as c:
            boxes = await asyncio.gather(
                *(
                    c.sandboxes.create(image=IMAGE, memory="64MiB", labels={"n": str(i)})
                    for i in range(50)
                )
            )
            await asyncio.gather(
                *(b.files.write("/state", f"box {i}") for i, b in enumerate(boxes))
            )
        srv.kill(signal.SIGKILL)
        assert init_processes(fresh_config) == 50  # the sandboxes outlive their agent

        srv.start()
        async with corral.AsyncClient(srv.url) as c:
            alive = await c.sandboxes.list()
            assert sorted(s.id for s in alive) == sorted(b.id for b in boxes)
            texts = await asyncio.gather(*(c.sandboxes.get(b.id) for b in boxes))
            reads = await asyncio.gather(*(s.files.read_text("/state") for s in texts))
            assert reads == [f"box {i}" for i in range(50)]
            r = await texts[7].commands.run("echo still here")
            assert r.stdout == "still here\n"
            await asyncio.gather(*(s.close() for s in texts))
    finally:
        srv.stop()
    assert init_processes(fresh_config) == 0
    assert not any(node_leftovers(fresh_config).values()), node_leftovers(fresh_config)
    assert not mounts.mounts_under(fresh_config.data_dir)


async def test_kill_9_in_the_middle_of_creates(fresh_config: NodeConfig, data_root: Path) -> None:
    srv = Server(fresh_config, data_root / f"{fresh_config.node}.sock")
    srv.start()
    try:
        async with corral.AsyncClient(srv.url) as c:
            tasks = [
                asyncio.create_task(c.sandboxes.create(image=IMAGE, memory="64MiB"))
                for _ in range(20)
            ]
            await asyncio.sleep(0.25)
            srv.kill(signal.SIGKILL)
            results = await asyncio.gather(*tasks, return_exceptions=True)
        made = [r for r in results if isinstance(r, corral.AsyncSandbox)]
        failed = [r for r in results if isinstance(r, BaseException)]
        assert all(isinstance(e, corral.CorralError) for e in failed), failed
        srv.start()
        async with corral.AsyncClient(srv.url) as c:
            alive = {s.id for s in await c.sandboxes.list()}
            # Finished creates survive; half-made ones were unwound on restart.
            assert {m.id for m in made} <= alive
            for s in await c.sandboxes.list():
                assert (await s.commands.run("echo ok")).stdout == "ok\n"
                await s.close()
    finally:
        srv.stop()
    assert init_processes(fresh_config) == 0
    assert not any(node_leftovers(fresh_config).values()), node_leftovers(fresh_config)


async def test_gc_reclaims_what_a_crash_left(fresh_config: NodeConfig) -> None:
    async with corral.AsyncClient(config=fresh_config) as c:
        sbx = await c.sandboxes.create(image=IMAGE)
        keep = await c.sandboxes.create(image=IMAGE)
        # Forge the aftermath of a crash: the record is gone, the resources are not.
        agent = c.service
        db = agent.store  # type: ignore[attr-defined]
        db.db.execute("DELETE FROM resources WHERE sandbox_id=?", (sbx.id,))
        db.db.execute("DELETE FROM sandboxes WHERE id=?", (sbx.id,))
        assert init_processes(fresh_config) == 2
    env = dict(
        os.environ, CORRAL_NODE=fresh_config.node, CORRAL_IMAGES=str(fresh_config.images_dir)
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "corral.cli.main",
            "--data-dir",
            str(fresh_config.data_dir),
            "--json",
            "gc",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["reclaimed"].get("container", 0) >= 1
    assert report["reclaimed"].get("subvolume", 0) == 1
    assert init_processes(fresh_config) == 1
    async with corral.AsyncClient(config=fresh_config) as c:
        s = await c.sandboxes.get(keep.id)
        assert (await s.commands.run("echo kept")).stdout == "kept\n"
        await s.close()
    await asyncio.sleep(0.1)
    assert not any(node_leftovers(fresh_config).values()), node_leftovers(fresh_config)
