"""The node's run dir on a tmpfs of its own (host/runfs.py): mounted by the
first agent, kept on disk while an older agent's sandboxes run from it,
never unmounted under a sandbox, gone with the last agent; containers'
bundles live there and not in the sandbox dir on disk."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

import corral
from corral.config import NodeConfig
from corral.guard.seccompd import OWN_FILES, SeccompDaemon
from corral.host import mounts, runfs
from corral.node.agent import NodeAgent

from ..framework import IMAGE, Node
from .test_nsexec import NSEXEC


def _tmpfs(path: Path) -> bool:
    return mounts.fs_magic(path) == runfs.TMPFS_MAGIC


def _bind_socket(path: Path) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()


def test_an_empty_run_dir_becomes_a_tmpfs_until_unmounted(tmp_path: Path) -> None:
    run = tmp_path / "run"
    try:
        runfs.mount(run, max_sandboxes=10)
        assert _tmpfs(run)
        assert run.stat().st_mode & 0o777 == 0o711  # traversable, not listable
        runfs.mount(run, max_sandboxes=10)  # a second agent: the same mount, not a stack
        assert len(mounts.mounts_under(run)) == 1
        # The node's daemon's, and a server's someone put here: no sandbox's.
        (run / "seccomp.sock").touch()
        _bind_socket(run / "preempt-4242.sock")
        runfs.unmount(run)
        assert mounts.mounts_under(run) == []
    finally:
        while mounts.umount(str(run)):
            pass


def test_a_tmpfs_the_owner_mounted_is_used_and_left_mounted(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    mounts.mount("tmpfs", str(run), "tmpfs", 0, "mode=0711")
    try:
        runfs.mount(run, max_sandboxes=10)
        assert len(mounts.mounts_under(run)) == 1
        runfs.unmount(run)
        assert len(mounts.mounts_under(run)) == 1
    finally:
        while mounts.umount(str(run)):
            pass


def test_a_disk_run_dir_that_sandboxes_still_use_is_left_on_disk(tmp_path: Path) -> None:
    for case, held in enumerate(("t-0123456789abcdef.sock", "oci/t-1", "bundles/t-1")):
        run = tmp_path / str(case) / "run"
        (run / held).parent.mkdir(parents=True)
        if held.endswith(".sock"):
            _bind_socket(run / held)
        else:
            (run / held).mkdir()
        runfs.mount(run, max_sandboxes=10)
        assert not _tmpfs(run), held
        assert (run / held).exists()


def test_a_run_tmpfs_a_sandbox_still_uses_is_not_unmounted(tmp_path: Path) -> None:
    run = tmp_path / "run"
    runfs.mount(run, max_sandboxes=10)
    try:
        for held in ("t-0123456789abcdef.sock", "oci/t-1", "bundles/t-1"):
            (run / held).parent.mkdir(exist_ok=True)
            if held.endswith(".sock"):
                _bind_socket(run / held)
            else:
                (run / held).mkdir()
            runfs.unmount(run)
            assert _tmpfs(run), held
            (run / held).unlink() if held.endswith(".sock") else (run / held).rmdir()
        runfs.unmount(run)
        assert mounts.mounts_under(run) == []
    finally:
        while mounts.umount(str(run)):
            pass


async def test_a_container_s_bundle_is_on_the_run_tmpfs_and_goes_with_it(
    fresh_node: Node, fresh_config: NodeConfig
) -> None:
    async with corral.AsyncClient(config=fresh_config) as client:
        sbx = await client.sandboxes.create(image=IMAGE)
        assert _tmpfs(fresh_config.run_dir)
        bundle = fresh_config.bundles_dir / sbx.id
        for name in ("init.pid", "layout.json", "rootfs", "stage"):
            assert (bundle / name).exists(), name
        # crun's copy of the config is its state's (corral-run keeps no
        # copy of its plan); the bundle's is gone.
        state = fresh_config.crun_root / sbx.id
        if fresh_config.oci_runtime == "crun":
            assert (state / "config.json").exists()
        assert state.is_dir()
        assert not (bundle / "config.json").exists() and not (bundle / "plan").exists()
        assert not (fresh_config.sandboxes_dir / sbx.id / "config.json").exists()
        assert (await sbx.commands.run("echo ok")).stdout == "ok\n"
        await sbx.close()
        assert not bundle.exists()
    assert mounts.mounts_under(fresh_config.data_dir) == []


async def _works(client: corral.AsyncClient) -> None:
    sbx = await client.sandboxes.create(image=IMAGE)
    try:
        assert (await sbx.commands.run("echo ok")).stdout == "ok\n"
    finally:
        await sbx.close()


async def test_an_agent_that_leaves_takes_nothing_from_one_that_stays(
    fresh_node: Node, fresh_config: NodeConfig
) -> None:
    # The first agent leads; leaving with no sandbox, it once stopped the
    # node's seccomp daemon under the agent that stayed.
    first = corral.AsyncClient(config=fresh_config)
    await first.__aenter__()
    second = corral.AsyncClient(config=fresh_config)
    try:
        await second.__aenter__()
    finally:
        await first.__aexit__(None, None, None)
    async with second:
        await _works(second)
    assert mounts.mounts_under(fresh_config.data_dir) == []


async def test_an_agent_starting_while_the_last_one_leaves_gets_a_whole_node(
    fresh_node: Node, fresh_config: NodeConfig
) -> None:
    # The last agent's teardown (seccomp daemon, run tmpfs) and the next
    # agent's start are serialised by the pool's lock: the newcomer finds
    # all of it or none of it, never a daemon whose socket went with the
    # tmpfs (`corral demo` ran into that).
    for _ in range(3):
        leaving = corral.AsyncClient(config=fresh_config)
        await leaving.__aenter__()
        coming = corral.AsyncClient(config=fresh_config)
        await asyncio.gather(leaving.__aexit__(None, None, None), coming.__aenter__())
        async with coming:
            await _works(coming)
    assert mounts.mounts_under(fresh_config.data_dir) == []


def test_a_seccomp_daemon_still_binding_its_socket_is_waited_for(tmp_path: Path) -> None:
    # Another agent's daemon on a new run tmpfs: its lock is held, its
    # socket not bound yet. A second start would find the lock held and
    # exit ("did not start"); ensure() waits for the socket instead.
    (tmp_path / "run").mkdir()
    daemon = SeccompDaemon(tmp_path, NSEXEC.parent / "corral-seccompd")
    holder = subprocess.Popen(
        ["flock", "-o", str(daemon.lock), "sleep", "30"], start_new_session=True
    )
    try:
        for _ in range(200):
            if daemon.running_pid() is not None:
                break
            time.sleep(0.01)
        daemon.lock.write_text(str(holder.pid))
        binding = threading.Timer(0.3, _bind_socket, [daemon.socket])
        binding.start()
        assert daemon.ensure() is False
        binding.join()
    finally:
        os.killpg(holder.pid, signal.SIGKILL)  # flock and its sleep
        holder.wait()


def test_agents_that_start_at_once_share_one_seccomp_daemon(tmp_path: Path) -> None:
    # Two agents of a node that both found no daemon both started one; the
    # one whose daemon lost the lock failed its create (seen in CI).
    (tmp_path / "run").mkdir()
    daemons = [SeccompDaemon(tmp_path, NSEXEC.parent / "corral-seccompd") for _ in range(4)]
    barrier = threading.Barrier(len(daemons))
    started: list[bool | BaseException] = []

    def start(d: SeccompDaemon) -> None:
        barrier.wait()
        try:
            started.append(d.ensure())
        except BaseException as e:  # reported below, with the others
            started.append(e)

    threads = [threading.Thread(target=start, args=(d,)) for d in daemons]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert sorted(started, key=str) == [False, False, False, True], started
    finally:
        daemons[0].stop()


def test_the_seccomp_daemon_takes_its_hard_open_files_limit(tmp_path: Path) -> None:
    # A login shell's soft limit (1,024 on a stock Debian) would stop the
    # node at ~1,000 containers: the daemon raises it to the hard one, and
    # reports what that allows.
    (tmp_path / "run").mkdir()
    daemon = SeccompDaemon(tmp_path, NSEXEC.parent / "corral-seccompd")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard <= 1024:
        pytest.skip(f"requires a finite hard RLIMIT_NOFILE above 1024 (it is {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        assert daemon.ensure() is True
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        pid = daemon.running_pid()
        assert pid is not None and pid > 0
        assert daemon.listener_capacity() == hard - OWN_FILES
    finally:
        daemon.stop()


async def test_a_node_admits_no_more_containers_than_its_daemon_can_hold(
    fresh_config: NodeConfig,
) -> None:
    async with corral.AsyncClient(config=fresh_config) as client:
        agent = client.service
        assert isinstance(agent, NodeAgent)
        listeners = agent.parts.admission.listeners
        capacity = agent.parts.seccompd.listener_capacity()
        assert capacity is not None and listeners is not None
        assert listeners == (capacity - fresh_config.fncall_workers, frozenset({"container"}))
