"""What a node holds in the kernel, on disk and in processes, found from
outside (not from its records): a crash or gc test asserts all of it is
gone, a bad-input test that none of it grew."""

from __future__ import annotations

import os
from pathlib import Path

from corral.config import NodeConfig
from corral.host import mounts
from corral.host.cgroups import Cgroups


def _count(path: Path, pattern: str = "*") -> int:
    return len(list(path.glob(pattern))) if path.exists() else 0


def _cmdline(pid: Path) -> list[str] | None:
    try:
        raw = (pid / "cmdline").read_bytes()
    except OSError:
        return None  # gone meanwhile
    return raw.decode(errors="replace").split("\0")[:-1]


def init_processes(config: NodeConfig) -> list[int]:
    """corral-init processes (sandboxes' PID 1) in this node's cgroups. A
    dead one the host's PID 1 has yet to reap is not counted (an init whose
    agent is not its subreaper is the host's to reap); one dead under an
    agent is (the agent must reap its own)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (d / "comm").read_text().strip() != "corral-init":
                continue
            state, ppid = (d / "stat").read_text().rsplit(")", 1)[1].split()[:2]
            if state == "Z" and ppid == "1":
                continue
            if f"/{config.cgroup_parent}/" in (d / "cgroup").read_text():
                found.append(int(d.name))
        except OSError:
            continue
    return sorted(found)


def zombies_of_this_process() -> list[tuple[int, str]]:
    """(pid, name) of this process's children that exited and were never
    reaped: what an embedded agent must not leave in its caller."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            head, tail = (d / "stat").read_text().rsplit(")", 1)
        except OSError:
            continue
        state, ppid = tail.split()[:2]
        if state == "Z" and int(ppid) == os.getpid():
            found.append((int(d.name), head.split("(", 1)[1]))
    return found


def qemu_processes(config: NodeConfig, sandbox_id: str | None = None) -> list[int]:
    """QEMU processes of this node's VMs (of one sandbox, if given): their
    sockets and logs lie in the node's sandbox directories."""
    where = f"{config.sandboxes_dir}/{sandbox_id + '/' if sandbox_id else ''}"
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        argv = _cmdline(d)
        if argv and Path(argv[0]).name.startswith("qemu-system") and any(where in a for a in argv):
            found.append(int(d.name))
    return sorted(found)


def leftovers(config: NodeConfig) -> dict[str, int]:
    """Counts of what the node holds, without the zeros: {} when it holds
    nothing (no sandbox open, no agent mid-create)."""
    scratch = config.scratch_dir
    counts = {
        "overlay_mounts": sum(
            1
            for mount_point, fs, _src in mounts.mount_table()
            if fs == "overlay" and str(config.data_dir) in mount_point
        ),
        "sandbox_dirs": _count(config.sandboxes_dir),
        "subvolumes": len([p for p in scratch.iterdir() if p.is_dir()])
        if mounts.is_mounted(scratch)
        else 0,
        "cgroups": len(Cgroups(config.cgroup_parent, unified=config.unified_dir).present()),
        # seccomp.sock is the node's own (its seccomp notifier), not a sandbox's.
        "sockets": len([p for p in config.run_dir.glob("*.sock") if p.name != "seccomp.sock"])
        if config.run_dir.exists()
        else 0,
        "oci_state": _count(config.crun_root),
        # The seccomp daemon's per-sandbox counts (folded into the records at close).
        "seccomp_counts": _count(config.data_dir / "audit", "*.seccomp"),
        "bundles": _count(config.bundles_dir),
        "init_processes": len(init_processes(config)),
        "qemu_processes": len(qemu_processes(config)),
    }
    return {k: n for k, n in counts.items() if n}
