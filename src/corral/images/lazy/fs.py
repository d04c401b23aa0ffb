"""The FUSE file system of the lazy loader (pyfuse3 on libfuse3).

    <mount>/<layer digest hex>   a layer's data blob, read-only, fetched
                                 chunk by chunk on first read
    <mount>/.stats               JSON: per layer, bytes served and fetched,
                                 cache hits, corrupt chunks, failed reads

EROFS mounts a layer's metadata image with ``device=<mount>/<hex>``, so the
kernel asks here only for blob ranges it does not have in its page cache.
Files are immutable: attributes and pages are cached by the kernel for good.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import pyfuse3
import trio

from corral.errors import CorralError
from corral.images.lazy.cache import ChunkCache
from corral.images.lazy.reader import LayerReader
from corral.images.objects import open_store, operator_key
from corral.images.store import ImageStore
from corral.log import get_logger

log = get_logger("corral.lazy")

STATS_INODE = pyfuse3.ROOT_INODE + 1
FOREVER = 1e9


class LazyFS(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(
        self,
        images: ImageStore,
        cache: ChunkCache,
        *,
        readahead: int,
        attempts: int,
        deadline: float,
        threads: int = 32,
    ) -> None:
        super().__init__()
        self.images = images
        self.cache = cache
        self.readahead = readahead
        self.attempts = attempts
        self.deadline = deadline
        self.limiter = trio.CapacityLimiter(threads)
        self.readers: dict[int, LayerReader] = {}  # inode -> reader
        self.inodes: dict[str, int] = {}  # layer hex -> inode
        self.open_count: dict[int, int] = {}
        self.handles: dict[int, tuple[int, bytes | None]] = {}  # fh -> (inode, snapshot)
        self.next_inode = STATS_INODE + 1
        self.next_fh = 1
        self.started = time.time()

    # ------------------------------------------------------------ helpers

    def pinned(self) -> set[str]:
        return {self.readers[i].key for i, n in self.open_count.items() if n > 0}

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = inode
        a.entry_timeout = FOREVER
        a.attr_timeout = FOREVER
        a.st_uid = a.st_gid = 0
        a.st_nlink = 1
        stamp = int(self.started * 1e9)
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = stamp
        if inode == pyfuse3.ROOT_INODE:
            a.st_mode = stat.S_IFDIR | 0o555
            a.st_nlink = 2
        elif inode == STATS_INODE:
            a.st_mode = stat.S_IFREG | 0o444
            a.entry_timeout = a.attr_timeout = 0
            a.st_size = 0
        else:
            a.st_mode = stat.S_IFREG | 0o444
            a.st_size = self.readers[inode].size
        a.st_blksize = 65536
        a.st_blocks = (a.st_size + 511) // 512
        return a

    def _reader(self, hexdigest: str) -> int:
        inode = self.inodes.get(hexdigest)
        if inode is not None:
            return inode
        layer = self.images.get("sha256:" + hexdigest)
        local = self.images.blob_path(layer.blob_digest)
        origin = self.images.origin(layer.digest)
        if not local.exists() and origin is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        reader = LayerReader(
            layer,
            store=None if local.exists() else open_store(origin or "", operator_key()),
            local_blob=local if local.exists() else None,
            cache=self.cache,
            pinned=self.pinned,
            readahead=self.readahead,
            attempts=self.attempts,
            deadline=self.deadline,
        )
        inode = self.next_inode
        self.next_inode += 1
        self.readers[inode] = reader
        self.inodes[hexdigest] = inode
        self.open_count[inode] = 0
        return inode

    def stats(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "cache_bytes": self.cache.bytes,
            "cache_evicted_chunks": self.cache.evicted,
            "layers": {
                "sha256:" + hexd: {**self.readers[i].stats.to_json(), "open": self.open_count[i]}
                for hexd, i in self.inodes.items()
            },
        }

    # ------------------------------------------------------------ operations

    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> Any:
        if parent_inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOENT)
        text = name.decode(errors="replace")
        if text == ".stats":
            return self._attr(STATS_INODE)
        if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
            raise pyfuse3.FUSEError(errno.ENOENT)
        try:
            inode = self._reader(text)
        except CorralError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None
        return self._attr(inode)

    async def getattr(self, inode: int, ctx: Any = None) -> Any:
        if inode not in (pyfuse3.ROOT_INODE, STATS_INODE) and inode not in self.readers:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attr(inode)

    async def opendir(self, inode: int, ctx: Any) -> int:
        if inode != pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return 0

    async def readdir(self, fh: int, start_id: int, token: Any) -> None:
        entries = [(".stats", STATS_INODE), *sorted(self.inodes.items())]
        for i, (name, inode) in enumerate(entries[start_id:], start=start_id):
            if not pyfuse3.readdir_reply(token, name.encode(), self._attr(inode), i + 1):
                break

    async def open(self, inode: int, flags: int, ctx: Any) -> Any:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise pyfuse3.FUSEError(errno.EROFS)
        fh = self.next_fh
        self.next_fh += 1
        if inode == STATS_INODE:
            self.handles[fh] = (inode, json.dumps(self.stats()).encode())
            return pyfuse3.FileInfo(fh=fh, direct_io=True)
        if inode not in self.readers:
            raise pyfuse3.FUSEError(errno.ENOENT)
        self.handles[fh] = (inode, None)
        self.open_count[inode] += 1
        return pyfuse3.FileInfo(fh=fh, keep_cache=True)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        inode, snapshot = self.handles[fh]
        if snapshot is not None:
            return snapshot[off : off + size]
        reader = self.readers[inode]
        try:
            data: bytes = await trio.to_thread.run_sync(
                reader.read, off, size, limiter=self.limiter
            )
        except Exception as exc:
            log.warning(
                "lazy.read_failed",
                layer=reader.layer.digest[:19],
                offset=off,
                size=size,
                error=str(exc),
            )
            raise pyfuse3.FUSEError(errno.EIO) from None
        return data

    async def release(self, fh: int) -> None:
        inode, snapshot = self.handles.pop(fh)
        if snapshot is None:
            self.open_count[inode] -= 1

    async def statfs(self, ctx: Any) -> Any:
        s = pyfuse3.StatvfsData()
        s.f_bsize = s.f_frsize = 65536
        return s


def serve(mount: Path, fs: LazyFS) -> None:
    options = set(pyfuse3.default_options)
    options.discard("default_permissions")
    options |= {"fsname=corral-lazy", "allow_other", "ro"}
    pyfuse3.init(fs, str(mount), options)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=False)
