"""The node's chunk cache: the blob chunks fetched so far, on local disk.

Per blob, a sparse data file (chunks at their offsets) and a bitmap of the
chunks present. A chunk is written, then its bit: after a crash a bit may
claim a chunk whose data never landed, which is why every chunk read from
the cache is verified against its digest and refetched when wrong. So the
cache survives restarts and heals itself; it never needs to be trusted.

Bounded: past max_bytes, the least recently used chunks of blobs no
mounted layer holds open are evicted (their space punched out of the
sparse file); chunks of open blobs go only if nothing else is left.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_FALLOC_PUNCH_HOLE_KEEP_SIZE = 0x02 | 0x01


def punch_hole(fd: int, offset: int, length: int) -> None:
    if (
        _libc.fallocate(
            fd, _FALLOC_PUNCH_HOLE_KEEP_SIZE, ctypes.c_long(offset), ctypes.c_long(length)
        )
        != 0
    ):
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@dataclass
class _Blob:
    key: str
    data_fd: int
    map_fd: int
    bitmap: bytearray
    chunk_size: int
    atime: dict[int, float] = field(default_factory=dict)

    def has(self, idx: int) -> bool:
        return bool(self.bitmap[idx >> 3] & (1 << (idx & 7)))

    def set(self, idx: int, present: bool) -> None:
        byte = idx >> 3
        if present:
            self.bitmap[byte] |= 1 << (idx & 7)
        else:
            self.bitmap[byte] &= ~(1 << (idx & 7)) & 0xFF
        os.pwrite(self.map_fd, bytes([self.bitmap[byte]]), byte)


class ChunkCache:
    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        root.mkdir(parents=True, exist_ok=True)
        self._blobs: dict[str, _Blob] = {}
        self._lock = threading.Lock()
        self.bytes = 0
        self.evicted = 0
        # What a previous run left is still valid (and verified on read).
        for meta in root.glob("*.meta"):
            try:
                chunk_size, size = (int(x) for x in meta.read_text().split())
            except (OSError, ValueError):
                continue
            blob = self._open(meta.stem, size, chunk_size)
            self.bytes += sum(bin(b).count("1") for b in blob.bitmap) * chunk_size

    def _open(self, key: str, size: int, chunk_size: int) -> _Blob:
        blob = self._blobs.get(key)
        if blob is not None:
            return blob
        nchunks = (size + chunk_size - 1) // chunk_size
        data = os.open(self.root / f"{key}.data", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if os.fstat(data).st_size != size:
            os.ftruncate(data, size)
        mapfd = os.open(self.root / f"{key}.map", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        raw = os.pread(mapfd, (nchunks + 7) // 8, 0)
        bitmap = bytearray(raw.ljust((nchunks + 7) // 8, b"\0"))
        (self.root / f"{key}.meta").write_text(f"{chunk_size} {size}")
        blob = _Blob(key, data, mapfd, bitmap, chunk_size)
        self._blobs[key] = blob
        return blob

    def get(self, key: str, size: int, chunk_size: int, idx: int, length: int) -> bytes | None:
        with self._lock:
            blob = self._open(key, size, chunk_size)
            if not blob.has(idx):
                return None
            blob.atime[idx] = time.monotonic()
            fd = blob.data_fd
        return os.pread(fd, length, idx * chunk_size)

    def put(
        self, key: str, size: int, chunk_size: int, idx: int, data: bytes, pinned: set[str]
    ) -> None:
        with self._lock:
            blob = self._open(key, size, chunk_size)
            os.pwrite(blob.data_fd, data, idx * chunk_size)
            if not blob.has(idx):
                self.bytes += chunk_size
            blob.set(idx, True)
            blob.atime[idx] = time.monotonic()
            if self.bytes > self.max_bytes:
                self._evict(pinned)

    def drop(self, key: str, size: int, chunk_size: int, idx: int) -> None:
        """Forget a chunk (e.g. one that failed verification)."""
        with self._lock:
            blob = self._open(key, size, chunk_size)
            if blob.has(idx):
                blob.set(idx, False)
                self.bytes -= chunk_size
                punch_hole(blob.data_fd, idx * chunk_size, chunk_size)

    def _evict(self, pinned: set[str]) -> None:
        target = int(self.max_bytes * 0.9)
        for only_unpinned in (True, False):
            candidates = [
                (blob.atime.get(idx, 0.0), blob, idx)
                for blob in self._blobs.values()
                if not (only_unpinned and blob.key in pinned)
                for idx in range(len(blob.bitmap) * 8)
                if blob.has(idx)
            ]
            candidates.sort(key=lambda c: c[0])
            for _atime, blob, idx in candidates:
                if self.bytes <= target:
                    return
                blob.set(idx, False)
                blob.atime.pop(idx, None)
                punch_hole(blob.data_fd, idx * blob.chunk_size, blob.chunk_size)
                self.bytes -= blob.chunk_size
                self.evicted += 1

    def close(self) -> None:
        with self._lock:
            for blob in self._blobs.values():
                os.close(blob.data_fd)
                os.close(blob.map_fd)
            self._blobs.clear()
