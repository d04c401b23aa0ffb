"""Per-sandbox writable space with a kernel-enforced size: btrfs subvolumes.

Why btrfs: the disk limit must be enforced by the kernel (ENOSPC/EDQUOT
inside the sandbox, the host disk untouched). XFS and ext4 project quotas
need CONFIG_QUOTA, which hosts like ours lack; btrfs qgroups do not. A
subvolume per sandbox also makes teardown O(1) (the kernel deletes it in the
background) and gives cheap snapshots for later (pack_diff, fork).

Where the node's data dir is already on btrfs, subvolumes are made there.
Otherwise a sparse image file is formatted once and loop-mounted at
<data>/scratch while any agent or sandbox of the node lives; the last agent
to leave with no sandbox left unmounts it (the loop device auto-clears).
"""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from corral.errors import ResourceExhausted, Unavailable
from corral.host import mounts
from corral.log import get_logger

log = get_logger("corral.scratch")

BTRFS_SUPER_MAGIC = 0x9123683E
_IOC_SUBVOL_CREATE = 0x5000940E
_IOC_SNAP_DESTROY = 0x5000940F
_IOC_QGROUP_LIMIT = 0x8030942B
_IOC_SNAP_CREATE_V2 = 0x50009417
_SUBVOL_RDONLY = 1 << 1
_QGROUP_LIMIT_MAX_RFER = 1
_VOL_ARGS = 4096
_NAME_MAX = 4087


def _vol_args(name: str) -> bytearray:
    raw = name.encode()
    if len(raw) > _NAME_MAX or "/" in name:
        raise ValueError(f"bad subvolume name {name!r}")
    buf = bytearray(_VOL_ARGS)
    buf[8 : 8 + len(raw)] = raw
    return buf


class Scratch:
    """The node's pool of sandbox subvolumes."""

    def __init__(self, root: Path, image: Path, size: int) -> None:
        self.root = root
        self.image = image
        self.size = size
        self._lock_path = root.parent / "scratch.mount.lock"
        self._users_path = root.parent / "scratch.users.lock"
        self._hold: int | None = None

    # ------------------------------------------------------------ lifecycle

    def open(self, also: Callable[[], None] | None = None) -> None:
        """Make the pool usable and hold a shared claim on it until close().

        Two locks: users.lock is held shared by every agent for its whole
        life; mount.lock is held exclusively around mounting and unmounting,
        so the last user's unmount cannot race a new user's mount. `also`
        runs under mount.lock too (the node's other mount: host/runfs.py)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with self._mount_lock():
            if mounts.fs_magic(self.root) != BTRFS_SUPER_MAGIC:
                self._mount_image()
            fd = os.open(self._users_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            if also is not None:
                try:
                    also()
                except BaseException:
                    os.close(fd)  # the pool stays mounted, as after a crash
                    raise
        self._hold = fd

    @property
    def held(self) -> bool:
        """open() succeeded and close() has not run."""
        return self._hold is not None

    @contextmanager
    def _mount_lock(self) -> Iterator[None]:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _mount_image(self) -> None:
        if not self.image.exists():
            log.info("scratch.format", image=str(self.image), size=self.size)
            tmp = self.image.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.truncate(self.size)
            _run(["mkfs.btrfs", "-q", "-f", str(tmp)], "formatting the scratch image")
            os.replace(tmp, self.image)
            fresh = True
        else:
            fresh = False
        _run(
            ["mount", "-o", "loop,noatime,discard=async", str(self.image), str(self.root)],
            "mounting the scratch image",
        )
        if fresh or not (self.root / ".quota").exists():
            _run(["btrfs", "quota", "enable", str(self.root)], "enabling btrfs quotas")
            (self.root / ".quota").touch()
        log.info("scratch.mounted", path=str(self.root))

    def close(self, sandboxes_left: int, also: Callable[[], None] | None = None) -> bool:
        """Release our claim; unmount if no other agent holds one and no
        sandbox is left on the pool. True if we were the last agent. `also`
        runs under mount.lock when we were, whatever is left."""
        if self._hold is None:
            return False
        fd, self._hold = self._hold, None
        with self._mount_lock():
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)  # another agent still uses the pool
                return False
            try:
                if also is not None:
                    also()
                # root is a mount point only when we loop-mounted the image.
                if sandboxes_left == 0 and mounts.is_mounted(self.root) and not self._subvolumes():
                    mounts.umount(str(self.root))
                    log.info("scratch.unmounted", path=str(self.root))
            finally:
                os.close(fd)
        return True

    def _subvolumes(self) -> list[str]:
        return [p.name for p in self.root.iterdir() if p.is_dir()]

    # ------------------------------------------------------------ subvolumes

    def device(self) -> tuple[int, int] | None:
        """(major, minor) of the block device the pool lives on (its loop
        device), for per-sandbox I/O throttling; None if it is not one."""
        for target, _fs, source in mounts.mount_table():
            if target == str(self.root) and source.startswith("/dev/"):
                try:
                    rdev = os.stat(source).st_rdev
                except OSError:
                    return None
                return os.major(rdev), os.minor(rdev)
        return None

    def path(self, name: str) -> Path:
        return self.root / name

    def create(self, name: str, limit: int) -> Path:
        """A subvolume holding upper/ and work/, limited to `limit` bytes."""
        dirfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                fcntl.ioctl(dirfd, _IOC_SUBVOL_CREATE, _vol_args(name))
            except FileExistsError:
                pass
            except OSError as exc:
                if exc.errno == 28:  # ENOSPC
                    raise ResourceExhausted("the node's scratch space is full") from exc
                raise Unavailable(f"creating scratch subvolume {name}: {exc}") from exc
        finally:
            os.close(dirfd)
        sub = self.root / name
        subfd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            # qgroupid 0 means "the subvolume this fd is in".
            args = struct.pack("<Q5Q", 0, _QGROUP_LIMIT_MAX_RFER, limit, 0, 0, 0)
            fcntl.ioctl(subfd, _IOC_QGROUP_LIMIT, bytearray(args))
        finally:
            os.close(subfd)
        (sub / "upper").mkdir(exist_ok=True)
        (sub / "work").mkdir(exist_ok=True)
        return sub

    def snapshot(self, name: str, snap: str) -> Path:
        """A read-only snapshot of subvolume `name` (instant, consistent)."""
        src = os.open(self.root / name, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        dirfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            args = bytearray(_VOL_ARGS)
            struct.pack_into("<qQQ", args, 0, src, 0, _SUBVOL_RDONLY)
            raw = snap.encode()
            if len(raw) > 4039 or "/" in snap:
                raise ValueError(f"bad snapshot name {snap!r}")
            args[56 : 56 + len(raw)] = raw
            fcntl.ioctl(dirfd, _IOC_SNAP_CREATE_V2, args)
        finally:
            os.close(src)
            os.close(dirfd)
        return self.root / snap

    def destroy(self, name: str) -> None:
        """Delete a subvolume; the kernel frees its blocks in the background."""
        dirfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.ioctl(dirfd, _IOC_SNAP_DESTROY, _vol_args(name))
        except FileNotFoundError:
            pass
        except OSError as exc:
            if exc.errno == 20:  # ENOTDIR: a plain directory left by a crash
                subprocess.run(["rm", "-rf", str(self.root / name)], check=False)
            else:
                raise
        finally:
            os.close(dirfd)

    def usage(self, name: str) -> tuple[int, int] | None:
        """(bytes referenced, limit) of a sandbox's subvolume."""
        proc = subprocess.run(
            ["btrfs", "qgroup", "show", "--raw", "-re", "-f", str(self.root / name)],
            capture_output=True,
            text=True,
        )
        for line in proc.stdout.splitlines():
            parts = line.split()
            if len(parts) >= 4 and parts[0].startswith("0/") and parts[1].isdigit():
                limit = int(parts[3]) if parts[3].isdigit() else 0
                return int(parts[1]), limit
        return None

    def names(self) -> list[str]:
        return self._subvolumes() if self.root.is_dir() else []


def _run(cmd: list[str], doing: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise Unavailable(f"{doing} failed: {' '.join(cmd)}: {proc.stderr.strip()}")
