"""The node's run directory (<data>/run) on a tmpfs of its own.

It holds what only running sandboxes need and nothing outlives: control
sockets, the OCI runtime's state, each container's bundle (config.json, pid
file, logs, mount points: runtimes/container/runtime.py). A Linux host's
/run is a tmpfs for the same reason, and crun keeps its state there by
default; the node keeps its own under its data dir, which is on disk.

Why it matters: a container's create and close make and remove about a
dozen inodes there. On ext4 under that churn, allocating an inode scans past
the recently deleted ones (ext4's recently_deleted()), and a mkdir costs
from 0.1 to 3 ms: measured with 16 creates in flight, the agent spent 7.5
ms of system time per create on a disk run dir and 1.3 ms on a tmpfs, and
the whole host 40 against 21 ms per create (docs/container-runtime.md).

Mounted by the first agent of a node and unmounted by the last to leave
with no sandbox left: the scratch pool's rule, under its lock (both are
called from Scratch.open/close). A run dir on disk that already holds a
sandbox's socket or runtime state (an agent of an older version left
sandboxes running) is left as it is: mounting over it would hide them. A
run dir its owner put on a tmpfs is used as it is, and never unmounted:
only the tmpfs holding the node's marker file is the node's.
"""

from __future__ import annotations

from pathlib import Path

from corral import ids
from corral.host import mounts
from corral.log import get_logger

log = get_logger("corral.runfs")

TMPFS_MAGIC = 0x01021994
# The largest bundle (the first sandbox's, whose config carries the seccomp
# rules) is ~50 KB with the runtime's copy of it; later ones ~16 KB.
PER_SANDBOX = 256 * 1024
FLOOR = 64 * 2**20
# In the tmpfs the node mounted: a run dir its owner put on a tmpfs of
# their own is theirs to unmount, not ours.
MARKER = ".corral-runfs"


def _in_use(run_dir: Path) -> list[str]:
    """What in a run dir says sandboxes still run from it: their control
    sockets (named by sandbox id), the OCI runtime's state and containers'
    bundles. Other sockets (the seccomp daemon's, a `corral serve
    --socket` someone put here) are no sandbox's."""
    held = [p.name for p in run_dir.glob("*.sock") if ids.node_of(p.stem) is not None]
    for sub in ("oci", "bundles"):  # a container's, from create to release
        if (run_dir / sub).is_dir():
            held += [f"{sub}/{p.name}" for p in (run_dir / sub).iterdir()]
    return held


def mount(run_dir: Path, max_sandboxes: int) -> None:
    """Make run_dir a tmpfs unless it is one already (another agent of
    the node mounted it) or sandboxes still run from it on disk."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if mounts.fs_magic(run_dir) == TMPFS_MAGIC:
        return
    held = _in_use(run_dir)
    if held:
        log.warning("runfs.kept_on_disk", path=str(run_dir), held=len(held), first=held[0])
        return
    size = max(FLOOR, max_sandboxes * PER_SANDBOX)
    mounts.mount("tmpfs", str(run_dir), "tmpfs", mounts.MS_NOSUID | mounts.MS_NODEV,
                 f"mode=0711,size={size}")  # fmt: skip
    (run_dir / MARKER).touch(mode=0o600)
    log.info("runfs.mounted", path=str(run_dir), size=size)


def unmount(run_dir: Path) -> None:
    """Unmount the run tmpfs, unless a sandbox still runs from it (an
    agent whose start failed while another's sandboxes live on). The
    seccomp daemon may still hold its socket: the unmount is lazy."""
    if not (mounts.is_mounted(run_dir) and (run_dir / MARKER).exists()):
        return
    held = _in_use(run_dir)
    if held:
        log.info("runfs.kept", path=str(run_dir), held=len(held))
        return
    mounts.umount(str(run_dir))
    log.info("runfs.unmounted", path=str(run_dir))
