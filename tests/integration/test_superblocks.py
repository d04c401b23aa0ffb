"""What a container mounts of its own: every superblock on the host costs
every memory cgroup a shrinker slot (docs/memory-reclaim.md), so a sandbox
brings only those isolation and its programs need (its overlay root,
/proc, a /dev tmpfs, devpts, its IPC namespace's mqueue, its network
namespace's sysfs). On cgroup v1 /sys/fs/cgroup is a bind of the
platform's skeleton with the sandbox's own cgroups bound on it, read-only,
and comes back the same after a disk suspend and in a fork."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import corral
from corral.host import mounts
from corral.host.cgroups import CGROUP_ROOT, Mode, detect
from corral.node.store import Store

from ..framework import IMAGE, Node

# The superblocks a container has that the host does not. /dev stays a
# tmpfs: glibc before 2.34 finds POSIX shared memory (shm_open, sem_open:
# multiprocessing's locks) only on a /dev/shm whose statfs says tmpfs.
OWN = ["devpts", "mqueue", "overlay", "proc", "sysfs", "tmpfs"]


def _init_pid(node: Node, sandbox_id: str) -> int:
    store = Store(node.config.db_path)
    try:
        rec = store.get(sandbox_id)
    finally:
        store.close()
    assert rec is not None and rec.init_pid is not None
    return rec.init_pid


def _mounts(pid: int | str) -> list[tuple[str, str, set[str], str, str]]:
    """(device, mount point, mount options, fs type, root) of each mount."""
    out = []
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        left, right = line.split(" - ", 1)
        f = left.split()
        out.append((f[2], f[4], set(f[5].split(",")), right.split()[0], f[3]))
    return out


def _own_superblocks(pid: int) -> list[str]:
    """The fs type of each superblock `pid` sees that the host's PID 1 does not."""
    host = {m[0] for m in _mounts(1)}
    return sorted({dev: fs for dev, _mp, _o, fs, _r in _mounts(pid) if dev not in host}.values())


def _cgroup_mounts(pid: int) -> dict[str, tuple[set[str], str, str]]:
    return {
        mp: (opts, fs, root)
        for _d, mp, opts, fs, root in _mounts(pid)
        if mp.startswith("/sys/fs/cgroup")
    }


async def _check_cgroups(node: Node, sbx: corral.AsyncSandbox, memory: int) -> None:
    """Its own limits at the roots of its cgroup mounts, all read-only."""
    mounts = _cgroup_mounts(_init_pid(node, sbx.id))
    hierarchies = node.agent.parts.cgroups.hierarchies
    assert set(mounts) == {"/sys/fs/cgroup", *(f"/sys/fs/cgroup/{h.name}" for h in hierarchies)}
    assert all("ro" in opts for opts, _fs, _root in mounts.values()), mounts
    assert mounts["/sys/fs/cgroup"][1] != "tmpfs"  # the skeleton's bind, not crun's tmpfs
    for mp, (_opts, fs, root) in mounts.items():
        if mp != "/sys/fs/cgroup":  # each the sandbox's own cgroup, no other's
            assert fs == "cgroup" and root.endswith(f"/{sbx.id}"), (mp, root)
    r = await sbx.commands.run(
        "cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/pids/pids.max"
    )
    assert r.stdout.split() == [str(memory), "512"], r.stdout


@pytest.fixture(autouse=True)
def _v1() -> None:
    if detect() is Mode.V2:
        pytest.skip("cgroup v2 host: /sys/fs/cgroup is one cgroup2 mount, no tmpfs to spare")


async def test_a_container_mounts_only_the_superblocks_it_needs(node: Node) -> None:
    async with node.client() as c:
        sbx = await c.sandboxes.create(image=IMAGE, memory="96MiB")
        try:
            assert _own_superblocks(_init_pid(node, sbx.id)) == OWN
            await _check_cgroups(node, sbx, 96 * 2**20)
            # /dev/shm: where old glibc looks for POSIX shared memory.
            r = await sbx.commands.run(
                "stat -f -c %T /dev/shm; python3 -c 'import multiprocessing as m; "
                'l = m.Lock(); l.acquire(); print("locked")\''
            )
            assert r.stdout.split() == ["tmpfs", "locked"], r
        finally:
            await sbx.close()


async def test_its_cgroup_mounts_come_back_after_disk_and_in_a_fork(node: Node) -> None:
    async with node.client() as c:
        src = await c.sandboxes.create(image=IMAGE, memory="112MiB")
        copies: list[corral.AsyncSandbox] = []
        try:
            await src.suspend(mode="disk")
            await src.resume()
            await _check_cgroups(node, src, 112 * 2**20)
            copies = await c.sandboxes.fork(src, 1)
            # The copy's own cgroups (another id's), bound by CRIU at restore.
            await _check_cgroups(node, copies[0], 112 * 2**20)
            assert _own_superblocks(_init_pid(node, copies[0].id)) == OWN
        finally:
            for x in [*copies, src]:
                await x.close()


@contextlib.contextmanager
def _host_cgroup_tmpfs() -> Iterator[Path]:
    """The host's /sys/fs/cgroup tmpfs without what is mounted on it: a
    non-recursive bind shows what lies beneath the cgroup2 mount."""
    with tempfile.TemporaryDirectory() as d:
        mounts.mount(str(CGROUP_ROOT), d, "", mounts.MS_BIND)
        try:
            yield Path(d)
        finally:
            mounts.umount(d)


async def test_a_hybrid_host_keeps_nothing_of_a_sandbox_beneath_its_cgroup2_mount(
    node: Node,
) -> None:
    """crun takes the directory left where corral-nsexec unmounted the
    cgroup2 hierarchy for that hierarchy and makes each container's cgroup
    in it: on the host's tmpfs, for good. The node's own directory takes
    them, and they go with the sandbox, through a disk suspend and a fork."""
    if detect() is not Mode.HYBRID:
        pytest.skip("not a hybrid cgroup host (no cgroup2 mount at /sys/fs/cgroup/unified)")
    parent = node.config.cgroup_parent
    with _host_cgroup_tmpfs() as host:
        beneath = host / "unified" / parent
        before = set(os.listdir(beneath)) if beneath.is_dir() else set()
        async with node.client() as c:
            src = await c.sandboxes.create(image=IMAGE)
            copies: list[corral.AsyncSandbox] = []
            try:
                if node.config.oci_runtime == "crun":  # crun makes one there; corral-run none
                    assert (node.config.unified_dir / parent / src.id / "cgroup.procs").is_file()
                await src.suspend(mode="disk")
                await src.resume()
                copies = await c.sandboxes.fork(src, 1)
                assert (await copies[0].commands.run("echo ok")).stdout == "ok\n"
            finally:
                for x in [*copies, src]:
                    await x.close()
        after = set(os.listdir(beneath)) if beneath.is_dir() else set()
        assert after == before, after - before
        assert not (node.config.unified_dir / parent / src.id).exists()


def test_a_node_sweeps_what_crun_left_beneath_the_cgroup2_mount_before(fresh_node: Node) -> None:
    """Hosts that ran a Corral without the node's own directory there hold
    a directory and a cgroup.procs file per container it ever made,
    beneath the mount: a node removes its own when it starts."""
    if detect() is not Mode.HYBRID:
        pytest.skip("not a hybrid cgroup host (no cgroup2 mount at /sys/fs/cgroup/unified)")
    parent = fresh_node.config.cgroup_parent
    with _host_cgroup_tmpfs() as host:
        left = host / "unified" / parent / f"{fresh_node.name}-0123456789abcdef"
        left.mkdir(parents=True)
        (left / "cgroup.procs").write_text("1\n")
        other = host / "unified" / "elsewhere"  # not this node's: kept
        other.mkdir(exist_ok=True)
        try:
            asyncio.run(_start_and_stop(fresh_node))
            assert not (host / "unified" / parent).exists()
            assert other.is_dir()
        finally:
            shutil.rmtree(host / "unified" / parent, ignore_errors=True)
            with contextlib.suppress(OSError):  # only if nothing else is there
                (host / "unified" / parent).parent.rmdir()
            other.rmdir()


async def _start_and_stop(node: Node) -> None:
    async with node.client() as c:
        await c.sandboxes.list()
