"""Corral's own runtime (oci_runtime = "corral", native/corral-run) makes
the sandbox crun makes: seen from inside, the same ids, capabilities,
filter, mounts, devices, limits and namespaces, and a failure leaves
nothing behind."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import tarfile
from pathlib import Path

import pytest

import corral
from corral.config import NodeConfig
from corral.images.oci import import_oci
from corral.images.store import ImageStore

from ..framework import IMAGE, Node, oci_layout

# What a sandbox's init sees of itself, one section per line group. The
# mount options of masks and read-only paths are left out of the
# comparison: corral-run's are stricter (nosuid, nodev, noexec on binds of
# /dev/null and of /proc's own directories, a read-only sysfs superblock).
PROBE = r"""
echo "== status"; grep -E '^(Cap|NoNewPrivs|Seccomp|Uid|Gid|Groups|NSpid)' /proc/1/status
echo "== mounts"; awk '{print $5, $(NF-2)}' /proc/1/mountinfo | sort
echo "== dev"; ls -la /dev | awk 'NR>1 {print $1, $3, $4, $NF}' | sort
echo "== limits"; grep -E 'open files|processes' /proc/1/limits
echo "== hostname"; hostname
echo "== idmap"; cat /proc/1/uid_map /proc/1/gid_map /proc/1/setgroups
echo "== cgroup"; cat /proc/1/cgroup
echo "== net"; ls /sys/class/net; cat /sys/class/net/lo/flags
echo "== oom"; cat /proc/1/oom_score_adj
echo "== fds"; ls /proc/1/fd | sort
echo "== sigs"; grep -E '^Sig(Blk|Ign|Cgt)' /proc/1/status
echo "== umask"; grep Umask /proc/1/status
echo "== session"; awk '{print $6, $8}' /proc/1/stat
echo "== ns"; ls /proc/1/ns | sort
echo "== cgfs"; ls /sys/fs/cgroup; cat /sys/fs/cgroup/memory/memory.limit_in_bytes \
  /sys/fs/cgroup/memory/memory.memsw.limit_in_bytes /sys/fs/cgroup/memory/memory.swappiness \
  /sys/fs/cgroup/pids/pids.max /sys/fs/cgroup/cpu/cpu.shares /sys/fs/cgroup/cpu/cpu.cfs_quota_us \
  /sys/fs/cgroup/cpuset/cpuset.cpus 2>&1; sort /sys/fs/cgroup/devices/devices.list
echo "== env"; env | grep -v -E '^(PWD|SHLVL|_)=' | sort
"""


def _node(cfg: NodeConfig, runtime: str, tmp: Path) -> Node:
    return Node(dataclasses.replace(cfg, data_dir=tmp / runtime, node="r" + runtime[:4],
                                    oci_runtime=runtime))  # fmt: skip


async def _view(node: Node) -> str:
    async with node.client() as c:
        s = await c.sandboxes.create(image=IMAGE, cpu=0.5, memory="512MiB", env={"K": "v w"})
        try:
            r = await s.commands.run(PROBE)
            assert r.exit_code == 0, r.stderr
            return r.stdout.replace(node.config.node, "NODE")
        finally:
            await s.close()


@pytest.mark.integration
async def test_corral_run_makes_the_sandbox_crun_makes(
    node_config: NodeConfig, data_root: Path
) -> None:
    views = {}
    for runtime in ("crun", "corral"):
        n = _node(node_config, runtime, data_root / "own-runtime")
        try:
            views[runtime] = await _view(n)
        finally:
            n.close()
    assert views["corral"] == views["crun"]
    # and the view is what it should be, not merely the same
    v = views["corral"]
    assert "NoNewPrivs:\t1" in v and "Seccomp:\t2" in v and "CapEff:\t00000000000405fb" in v


@pytest.mark.integration
async def test_a_failed_start_leaves_nothing(node_config: NodeConfig, data_root: Path) -> None:
    """A plan corral-run cannot carry out (a device the host lacks) fails
    the create with corral-run's words, and the node keeps no cgroup,
    bundle, mount or process of it."""
    from corral.runtimes.container import runplan

    n = _node(node_config, "corral", data_root / "own-runtime-fail")
    saved = runplan.DEVICES
    runplan.DEVICES = (*saved, "no-such-device")
    try:
        async with n.client() as c:
            with pytest.raises(corral.SandboxFailed, match=r"corral-run: .*no-such-device"):
                await c.sandboxes.create(image=IMAGE)
            assert await c.sandboxes.list() == []
        cg = Path("/sys/fs/cgroup/memory/corral") / n.config.node
        assert not cg.exists() or not [p for p in cg.iterdir() if p.is_dir()]
        bundles = n.config.bundles_dir
        assert not bundles.exists() or not list(bundles.iterdir())
    finally:
        runplan.DEVICES = saved
        n.close()
    assert str(n.config.data_dir) not in Path("/proc/mounts").read_text()


def _symlinked_proc_image(root: Path) -> Path:
    """An OCI layout whose /proc is a symlink that, followed, would put the
    sandbox's proc where the masks after it cannot find it (under /dev,
    which the /dev tmpfs then hides)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:

        def entry(name: str, kind: bytes, link: str = "", data: bytes = b"") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mode, info.size = kind, link, 0o755, len(data)
            tar.addfile(info, io.BytesIO(data))

        entry("bin", tarfile.DIRTYPE)
        entry("bin/busybox", tarfile.REGTYPE, data=Path("/bin/busybox").read_bytes())
        entry("bin/sh", tarfile.SYMTYPE, "busybox")
        for d in ("dev", "dev/x", "realproc", "sys", "tmp"):
            entry(d, tarfile.DIRTYPE)
        entry("proc", tarfile.SYMTYPE, "dev/x/../../realproc")
    return oci_layout(root, [buf.getvalue()], {"Env": ["PATH=/bin"]})


@pytest.mark.integration
async def test_an_image_cannot_move_a_mount_with_a_symlink(
    node_config: NodeConfig, data_root: Path, tmp_path: Path
) -> None:
    """/proc -> /dev/x/../../realproc in the image: followed, the proc
    mount would land on /realproc and every mask (looked up at /proc) would
    find nothing and be skipped. corral-run resolves no symlink on a
    target's path: the create fails, naming it, and leaves nothing."""
    store = ImageStore(node_config.images_dir)
    import_oci(store, _symlinked_proc_image(tmp_path / "oci"), tag="symlinked-proc:1",
               progress=lambda *a: None)  # fmt: skip
    n = _node(node_config, "corral", data_root / "own-runtime-symlink")
    try:
        async with n.client() as c:
            with pytest.raises(
                corral.SandboxFailed, match=r"/proc: the image has a symlink on its path"
            ):
                await c.sandboxes.create(image="symlinked-proc:1")
            assert await c.sandboxes.list() == []
        bundles = n.config.bundles_dir
        assert not bundles.exists() or not list(bundles.iterdir())
    finally:
        n.close()
        store.untag("symlinked-proc:1")
    assert str(n.config.data_dir) not in Path("/proc/mounts").read_text()


async def _dead(pid: int) -> bool:
    """Gone or a zombie within 5 s."""
    for _ in range(50):
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        await asyncio.sleep(0.1)
    return False


async def test_a_start_that_never_ends_is_killed_and_leaves_nothing(
    node_config: NodeConfig, data_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runtime whose start never returns (a task stuck in the kernel
    while its mounts are made) is killed at START_TIMEOUT: the create
    fails naming the bound, and nothing of it is left. Before, nothing
    bounded it and the create held its caller for ever."""
    from corral.runtimes.container import oci

    stub = tmp_path / "corral-run"  # the name keeps corral-run's calling convention
    stub.write_text('#!/bin/sh\necho $$ >> "$0.pids"\nexec sleep 600\n')
    stub.chmod(0o755)
    monkeypatch.setattr(oci, "START_TIMEOUT", 3.0)
    n = _node(node_config, "corral", data_root / "own-runtime-stuck")
    try:
        async with n.client() as c:
            monkeypatch.setattr(n.agent.parts.runtimes["container"].oci, "binary", str(stub))
            with pytest.raises(corral.SandboxFailed, match=r"ran past 3 s; killed"):
                await c.sandboxes.create(image=IMAGE)
            assert await c.sandboxes.list() == []
            pids = stub.with_name("corral-run.pids").read_text().split()
            # corral-nsexec's child, killed by PDEATHSIG as nsexec is: dead
            # at once, reaped by whoever its orphan goes to.
            assert pids and all([await _dead(int(p)) for p in pids])
            assert n.leftovers() == {}
    finally:
        n.close()
    assert str(n.config.data_dir) not in Path("/proc/mounts").read_text()
