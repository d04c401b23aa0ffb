"""What a container mounts of its own: every superblock on the host costs
every memory cgroup a shrinker slot (docs/memory-reclaim.md), so a sandbox
brings only those isolation needs (its overlay root, /proc, devpts, its IPC
namespace's mqueue, its network namespace's sysfs). /dev is a bind of a
directory in its scratch subvolume and /sys/fs/cgroup a bind of the
platform's skeleton with its own cgroups bound on it; both work as before,
and /dev goes to disk and back, and into a fork, with the sandbox."""

from __future__ import annotations

from pathlib import Path

import corral
from corral.node.store import Store

from ..framework import IMAGE, Node

# The superblocks a container has that the host does not: what isolation
# needs, nothing else (a tmpfs /dev and crun's /sys/fs/cgroup tmpfs were two
# more).
OWN = {"overlay", "proc", "devpts", "mqueue", "sysfs"}


def _init_pid(node: Node, sandbox_id: str) -> int:
    store = Store(node.config.db_path)
    try:
        rec = store.get(sandbox_id)
    finally:
        store.close()
    assert rec is not None and rec.init_pid is not None
    return rec.init_pid


def _own_superblocks(pid: int) -> dict[str, str]:
    """Device number -> file system type of each superblock `pid` sees
    that the host's PID 1 does not."""

    def devs(p: str) -> dict[str, str]:
        out = {}
        for line in Path(f"/proc/{p}/mountinfo").read_text().splitlines():
            left, right = line.split(" - ", 1)
            out[left.split()[2]] = right.split()[0]
        return out

    host = devs("1")
    return {d: fs for d, fs in devs(str(pid)).items() if d not in host}


async def test_a_container_mounts_only_the_superblocks_isolation_needs(node: Node) -> None:
    async with node.client() as c:
        sbx = await c.sandboxes.create(image=IMAGE, memory="96MiB")
        try:
            own = _own_superblocks(_init_pid(node, sbx.id))
            assert sorted(own.values()) == sorted(OWN), own
            # /dev: the devices work, /dev/shm is a sticky directory, and a
            # user namespace cannot make a device node there.
            r = await sbx.commands.run(
                "head -c 4 /dev/zero | wc -c; echo x > /dev/null && echo null-ok; "
                "stat -c %a /dev/shm; echo s > /dev/shm/f && cat /dev/shm/f; "
                "readlink /dev/fd /dev/ptmx; "
                "mknod /dev/mem2 c 1 1 2>&1 || echo mknod-refused"
            )
            lines = r.stdout.split("\n")
            assert lines[:6] == ["4", "null-ok", "1777", "s", "/proc/self/fd", "pts/ptmx"], lines
            assert r.stdout.rstrip().endswith("mknod-refused"), r.stdout
            # A pty still comes from the sandbox's own devpts.
            pty = await sbx.commands.run("python3 -c 'import os,pty; m,s=pty.openpty(); "
                                         "print(os.ttyname(s))'")  # fmt: skip
            assert pty.ok and pty.stdout.startswith("/dev/pts/"), pty
            # /sys/fs/cgroup: its own cgroups as roots, read-only.
            r = await sbx.commands.run(
                "cat /sys/fs/cgroup/memory/memory.limit_in_bytes; "
                "cat /sys/fs/cgroup/pids/pids.max; "
                "mkdir /sys/fs/cgroup/memory/x 2>/dev/null || echo ro; "
                "touch /sys/fs/cgroup/y 2>/dev/null || echo ro"
            )
            assert r.stdout.split() == [str(96 * 2**20), "512", "ro", "ro"], r.stdout
        finally:
            await sbx.close()


async def test_dev_goes_to_disk_and_back_and_into_a_fork(node: Node) -> None:
    async with node.client() as c:
        src = await c.sandboxes.create(image=IMAGE, memory="96MiB")
        copies: list[corral.AsyncSandbox] = []
        try:
            await src.commands.run("echo kept > /dev/shm/state")
            await src.suspend(mode="disk")
            await src.resume()
            r = await src.commands.run("cat /dev/shm/state; head -c 3 /dev/zero | wc -c")
            assert r.stdout.split() == ["kept", "3"], r
            assert sorted(_own_superblocks(_init_pid(node, src.id)).values()) == sorted(OWN)
            copies = await c.sandboxes.fork(src, 1)
            (copy,) = copies
            r = await copy.commands.run("cat /dev/shm/state; echo mine > /dev/shm/state")
            assert r.stdout == "kept\n", r
            # Each its own /dev: the copy's write is not the source's.
            assert (await src.commands.run("cat /dev/shm/state")).stdout == "kept\n"
        finally:
            for x in [*copies, src]:
                await x.close()
