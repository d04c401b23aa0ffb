"""Reading a layer's data blob chunk by chunk, fetching what is missing.

Called from the FUSE daemon's worker threads. Guarantees:
  - every chunk that comes from the store or the cache is checked against
    its digest from the manifest; a bad one is dropped and fetched again
    (at most three times), and counted;
  - concurrent reads of one missing chunk fetch it once;
  - a miss also fetches the following missing chunks (readahead), in the
    same ranged request;
  - a store that is down or slow costs a bounded time (retries within a
    deadline), then the read fails (EIO in the sandbox that asked) while
    other reads go on; after such a failure the store is considered down
    for one deadline, so the kernel's retries of neighbouring pages fail at
    once instead of each waiting a deadline again (for two deadlines).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from corral.errors import Unavailable
from corral.images.layer import Layer
from corral.images.lazy.cache import ChunkCache
from corral.images.objects import ObjectStore, retrying
from corral.log import get_logger

log = get_logger("corral.lazy")
MAX_REFETCH = 3


class Breaker:
    """Per store: open (failing fast) for `cooldown` seconds after a fetch
    gave up; then one fetch at a time may try again."""

    _by_url: dict[str, Breaker] = {}
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.open_until = 0.0

    @classmethod
    def of(cls, url: str) -> Breaker:
        with cls._lock:
            return cls._by_url.setdefault(url, cls())

    def check(self, url: str) -> None:
        if time.monotonic() < self.open_until:
            raise Unavailable(f"blob store {url} is down (failing fast until it answers again)")

    def tripped(self, cooldown: float) -> None:
        self.open_until = time.monotonic() + cooldown

    def closed(self) -> None:
        self.open_until = 0.0


@dataclass
class LayerStats:
    blob_size: int = 0
    served_bytes: int = 0  # handed to the kernel
    fetched_bytes: int = 0  # pulled from the store
    fetched_chunks: int = 0
    fetch_requests: int = 0
    cache_hits: int = 0
    corrupt_chunks: int = 0
    failed_reads: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class LayerReader:
    def __init__(
        self,
        layer: Layer,
        *,
        store: ObjectStore | None,
        local_blob: Path | None,
        cache: ChunkCache,
        pinned: Callable[[], set[str]],
        readahead: int = 4,
        attempts: int = 4,
        deadline: float = 20.0,
    ) -> None:
        self.layer = layer
        self.key = layer.blob_digest.removeprefix("sha256:")
        self.size = layer.blob_size
        self.cs = layer.chunk_size
        self.store = store
        self.cache = cache
        self.pinned = pinned
        self.readahead = readahead
        self.attempts = attempts
        self.deadline = deadline
        self.stats = LayerStats(blob_size=layer.blob_size)
        self._local_fd = (
            os.open(local_blob, os.O_RDONLY | os.O_CLOEXEC) if local_blob is not None else None
        )
        self._lock = threading.Lock()
        self._inflight: dict[int, threading.Event] = {}

    def close(self) -> None:
        if self._local_fd is not None:
            os.close(self._local_fd)
            self._local_fd = None

    def _len(self, idx: int) -> int:
        return min(self.cs, self.size - idx * self.cs)

    def read(self, offset: int, size: int) -> bytes:
        end = min(offset + size, self.size)
        if offset >= end:
            return b""
        try:
            if self._local_fd is not None:
                # The blob is on this node's own disk: no cache, no copy.
                data = os.pread(self._local_fd, end - offset, offset)
                with self._lock:
                    self.stats.fetched_bytes += len(data)
            else:
                first, last = offset // self.cs, (end - 1) // self.cs
                whole = b"".join(self._chunk(i) for i in range(first, last + 1))
                start = offset - first * self.cs
                data = whole[start : start + end - offset]
        except Exception:
            with self._lock:
                self.stats.failed_reads += 1
            raise
        with self._lock:
            self.stats.served_bytes += len(data)
        return data

    def _verified(self, idx: int, data: bytes) -> bool:
        return hashlib.sha256(data).hexdigest() == self.layer.chunk_digests[idx]

    def _chunk(self, idx: int) -> bytes:
        while True:
            cached = self.cache.get(self.key, self.size, self.cs, idx, self._len(idx))
            if cached is not None:
                if self._verified(idx, cached):
                    with self._lock:
                        self.stats.cache_hits += 1
                    return cached
                self._corrupt(idx, "cache")
                self.cache.drop(self.key, self.size, self.cs, idx)
            with self._lock:
                waiting = self._inflight.get(idx)
                if waiting is None:
                    run = self._claim(idx)
            if waiting is not None:
                if not waiting.wait(self.deadline + 5):
                    raise Unavailable(f"chunk {idx} of {self.key[:12]}: fetch never finished")
                continue  # the fetcher put it in the cache (or failed: we try ourselves)
            try:
                got = self._fetch(run)
            finally:
                with self._lock:
                    for i in run:
                        self._inflight.pop(i).set()
            return got[idx]

    def _claim(self, idx: int) -> list[int]:
        """Mark idx and the missing chunks right after it as being fetched
        by us (caller holds the lock)."""
        run = [idx]
        self._inflight[idx] = threading.Event()
        nchunks = len(self.layer.chunk_digests)
        for nxt in range(idx + 1, min(idx + self.readahead, nchunks)):
            if (
                nxt in self._inflight
                or self.cache.get(self.key, self.size, self.cs, nxt, 0) is not None
            ):
                break
            self._inflight[nxt] = threading.Event()
            run.append(nxt)
        return run

    def _fetch(self, run: list[int]) -> dict[int, bytes]:
        assert self.store is not None
        store, key = self.store, f"blobs/sha256/{self.key}"
        start = run[0] * self.cs
        length = sum(self._len(i) for i in run)
        breaker = Breaker.of(store.url)
        breaker.check(store.url)
        try:
            raw = retrying(
                lambda remaining: store.get_range(key, start, length, timeout=remaining),
                attempts=self.attempts,
                timeout=self.deadline,
                what=f"fetching {length} bytes of {self.key[:12]} from {store.url}",
            )
        except Unavailable:
            # Two deadlines: long enough that the kernel's retries of the
            # neighbouring pages (which come after the first failure) fail fast.
            breaker.tripped(2 * self.deadline)
            raise
        breaker.closed()
        with self._lock:
            self.stats.fetch_requests += 1
            self.stats.fetched_bytes += len(raw)
        out: dict[int, bytes] = {}
        pinned = self.pinned()
        off = 0
        for i in run:
            data = raw[off : off + self._len(i)]
            off += self._len(i)
            tries = 0
            while not self._verified(i, data):
                self._corrupt(i, "store")
                tries += 1
                if tries > MAX_REFETCH:
                    raise Unavailable(
                        f"chunk {i} of {self.key[:12]} from {store.url} fails its digest "
                        f"after {MAX_REFETCH} fetches"
                    )
                data = retrying(
                    lambda remaining, i=i: store.get_range(
                        key, i * self.cs, self._len(i), timeout=remaining
                    ),
                    attempts=self.attempts,
                    timeout=self.deadline,
                    what=f"refetching chunk {i} of {self.key[:12]}",
                )
                with self._lock:
                    self.stats.fetch_requests += 1
                    self.stats.fetched_bytes += len(data)
            with self._lock:
                self.stats.fetched_chunks += 1
            self.cache.put(self.key, self.size, self.cs, i, data, pinned)
            out[i] = data
        return out

    def _corrupt(self, idx: int, where: str) -> None:
        with self._lock:
            self.stats.corrupt_chunks += 1
        log.warning("lazy.corrupt_chunk", blob=self.key[:16], chunk=idx, source=where)
