"""One read-only mount per layer per node, shared by every sandbox using it.

Why shared: each EROFS mount has its own page cache, so a mount per sandbox
would keep a copy of every hot page (libpython, the C library) per sandbox.
Mounted once, the pages are cached once for the whole node.

A layer mount lives in the host's mount namespace at <data>/m/<digest16>.
Sandboxes' overlays are made in private namespaces that copy it, so
unmounting it here (lazily) never disturbs a running sandbox; it only stops
new sandboxes from using it until it is mounted again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from corral.errors import Unavailable
from corral.host import mounts
from corral.images.layer import Layer
from corral.images.lazy.loader import LazyLoader
from corral.images.objects import open_store, operator_key
from corral.images.store import ImageStore
from corral.log import get_logger

log = get_logger("corral.layers")
# In a sandbox's dir: the loader epoch its layers were mounted in.
LOADER_STAMP = "loader-epoch"


class LayerMounts:
    def __init__(self, store: ImageStore, root: Path, lazy: LazyLoader | None = None) -> None:
        self.store = store
        self.root = root
        self.lazy = lazy
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, digest: str) -> Path:
        return self.root / digest.removeprefix("sha256:")[:16]

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The node's layer lock (across threads and agents), for the block."""
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def ensure(self, layer: Layer) -> Path:
        """Mount the layer unless it is mounted; return its path."""
        return self.ensure_all([layer])[0]

    def ensure_all(self, layers: Iterable[Layer], stamp: Path | None = None) -> list[Path]:
        """Mount each layer unless it is mounted; return their paths. With
        `stamp`, write there the loader epoch the paths belong to (see
        epoch()), under the same hold of the lock as the mounting.

        Under the lock file, always: another agent of the node (its leader's
        garbage collection) may have unmounted and removed it since this
        agent last mounted it. The caller's sandbox is recorded as active
        before it asks, and release_unused reads what is referenced under
        the same lock, so a layer found mounted here stays mounted until
        that sandbox is gone. A sandbox's layers are taken under one hold of
        the lock: a create pays one lock (and one trip off its loop)."""
        with self._locked():
            self._clear_if_loader_dead()
            targets = []
            for layer in layers:
                target = self.path(layer.digest)
                if not self._is_mounted(target):
                    target.mkdir(exist_ok=True)
                    self._mount(layer, target)
                    log.info("layer.mounted", digest=layer.digest, path=str(target))
                targets.append(target)
            if stamp is not None:
                stamp.write_text(str(self._epoch()))
        return targets

    def epoch(self) -> int:
        """How many times a dead loader's mounts were cleared on this node
        (0: never). A sandbox whose stamp (ensure_all) is below it reads
        through a dead loader, whichever agent cleared it: the leader fails
        it (node/housekeeping.py), even where a create cleared first."""
        with self._locked():
            return self._epoch()

    def _epoch(self) -> int:
        """Caller holds the layer lock."""
        try:
            return int((self.root / ".loader-epoch").read_text())
        except (FileNotFoundError, ValueError):
            return 0

    def _is_mounted(self, target: Path) -> bool:
        """A layer mount is another filesystem than the directory holding
        it: one stat, not a read of the mount table per create."""
        try:
            return os.stat(target).st_dev != os.stat(self.root).st_dev
        except FileNotFoundError:
            return False

    def _meta(self, layer: Layer) -> Path:
        """The metadata image, fetched whole from the layer's origin at
        first use (it is small: ~1 MB for a 165 MB Debian root)."""
        meta = self.store.blob_path(layer.meta_digest)
        if meta.exists():
            return meta
        origin = self.store.origin(layer.digest)
        if origin is None:
            raise Unavailable(f"layer {layer.digest}: metadata image missing and no origin known")
        key = f"blobs/sha256/{layer.meta_digest.removeprefix('sha256:')}"
        data = open_store(origin, operator_key()).get(key, layer.meta_size)
        # The host kernel parses this image: it must be the one the layer's
        # (verified) manifest names, byte for byte, whatever the store sent.
        if "sha256:" + hashlib.sha256(data).hexdigest() != layer.meta_digest:
            raise Unavailable(
                f"layer {layer.digest}: the metadata image from {origin} does not match its "
                "digest; not mounted"
            )
        tmp = meta.with_name(f".{meta.name}.tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, meta)
        return meta

    def _mount(self, layer: Layer, target: Path) -> None:
        meta = self._meta(layer)
        if not layer.blob_size:
            device = None
        elif self.lazy is not None:
            # Data comes through the node's lazy loader, chunk by chunk.
            self.lazy.ensure()
            device = self.lazy.device(layer.digest)
        else:
            device = self.store.blob_path(layer.blob_digest)
        # EROFS mounts a regular file directly (no loop device); the data
        # blob is the extra device holding the chunks.
        opts = f"device={device}" if device else None
        # nosuid, nodev: on the host, a layer's setuid files and device nodes
        # are inert (inside a sandbox its own mount decides, in its userns).
        flags = mounts.MS_RDONLY | mounts.MS_NOSUID | mounts.MS_NODEV
        mounts.mount(str(meta), str(target), "erofs", flags, opts)

    def clear_dead_loader(self) -> bool:
        """Unmount the layer mounts and the loader's if the loader is dead;
        True if they were. Decided under the layer lock: a create that has
        just replaced a dead loader keeps the mounts it made through the
        new one (a check made outside the lock once unmounted them under
        it, and the sandbox started on an empty root)."""
        with self._locked():
            return self._clear_if_loader_dead()

    def _clear_if_loader_dead(self) -> bool:
        """Caller holds the layer lock. A killed loader leaves its FUSE
        mount and every layer mount reading through it answering EIO:
        reusing them would hand a new sandbox a root it cannot exec from."""
        if not self._loader_dead():
            return False
        epoch = self._epoch() + 1
        log.warning("lazy.dead_mounts_cleared", root=str(self.root), epoch=epoch)
        self._unmount_all()
        tmp = self.root / ".loader-epoch.tmp"
        tmp.write_text(str(epoch))
        os.replace(tmp, self.root / ".loader-epoch")
        return True

    def _loader_dead(self) -> bool:
        """True when the loader's FUSE mount is there but no loader holds
        its lock (it was killed: its mount outlives it)."""
        return self.lazy is not None and self.lazy.running_pid() is None and self.lazy.mounted()

    def _unmount_all(self) -> None:
        """Caller holds the layer lock."""
        for mount_point, _fs, _src in mounts.mounts_under(self.root):
            mounts.umount(mount_point)
        if self.lazy is not None:
            self.lazy.stop()

    def release_all(self) -> None:
        """Unmount every layer mount (lazily: sandboxes still holding one
        keep their copy) and the loader: after the loader died."""
        with self._locked():
            self._unmount_all()

    def release_unused(self, in_use: Callable[[], Iterable[str]]) -> list[str]:
        """Unmount every layer mount of this node that no sandbox references.
        `in_use` (the layers of the node's active sandboxes) is read under
        the lock: a create recorded before it can no longer lose its layers
        between its ensure() and its start."""
        released = []
        with self._locked():
            keep = {self.path(d).name for d in in_use()}
            for mount_point, _fstype, _src in mounts.mounts_under(self.root):
                name = Path(mount_point).name
                if Path(mount_point).parent != self.root or name in keep:
                    continue
                mounts.umount(mount_point)
                released.append(name)
            for entry in self.root.iterdir():
                if entry.is_dir() and entry.name not in keep and not mounts.is_mounted(entry):
                    entry.rmdir()
            if self.lazy is not None and not mounts.mounts_under(self.root):
                self.lazy.stop()  # no layer mount reads through it any more
        if released:
            log.info("layer.released", count=len(released))
        return released
