"""The chunk cache and the verified, coalescing chunk reader (no FUSE here)."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from corral.errors import NotFound, Unavailable
from corral.images.layer import ImageConfig, Layer
from corral.images.lazy.cache import ChunkCache
from corral.images.lazy.reader import LayerReader
from corral.images.objects import LocalObjects

CS = 4096


def _layer(blob: bytes) -> Layer:
    digests = [hashlib.sha256(blob[i : i + CS]).hexdigest() for i in range(0, len(blob), CS)]
    bd = "sha256:" + hashlib.sha256(blob).hexdigest()
    return Layer(
        digest="sha256:" + "1" * 64,
        kind="base",
        meta_digest="sha256:" + "2" * 64,
        meta_size=1,
        blob_digest=bd,
        blob_size=len(blob),
        chunk_size=CS,
        chunk_digests=digests,
        content_size=len(blob),
        config=ImageConfig(),
        created=0.0,
    )


@pytest.fixture
def blob() -> bytes:
    return os.urandom(CS * 20 + 100)  # 21 chunks, the last one short


def _store(tmp_path: Path, layer: Layer, data: bytes) -> LocalObjects:
    store = LocalObjects(tmp_path / "store")
    store.put_bytes(f"blobs/sha256/{layer.blob_digest.removeprefix('sha256:')}", data)
    return store


def _reader(tmp_path: Path, layer: Layer, store: object, **kw: object) -> LayerReader:
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    return LayerReader(
        layer,
        store=store,
        local_blob=None,
        cache=cache,  # type: ignore[arg-type]
        pinned=set,
        **kw,
    )  # type: ignore[arg-type]


def test_reads_any_range_and_fetches_only_what_is_read(tmp_path: Path, blob: bytes) -> None:
    layer = _layer(blob)
    r = _reader(tmp_path, layer, _store(tmp_path, layer, blob), readahead=1)
    assert r.read(CS - 10, 30) == blob[CS - 10 : CS + 20]  # spans two chunks
    assert r.read(len(blob) - 50, 500) == blob[-50:]  # past the end
    assert r.read(len(blob) + 10, 10) == b""
    assert r.stats.fetched_chunks == 3
    assert r.stats.fetched_bytes == 2 * CS + 100
    assert r.read(CS, 10) == blob[CS : CS + 10]
    assert r.stats.fetched_chunks == 3 and r.stats.cache_hits >= 1


def test_readahead_fetches_following_chunks_in_one_request(tmp_path: Path, blob: bytes) -> None:
    layer = _layer(blob)
    r = _reader(tmp_path, layer, _store(tmp_path, layer, blob), readahead=8)
    r.read(0, 10)
    assert r.stats.fetch_requests == 1 and r.stats.fetched_chunks == 8
    assert r.read(0, len(blob)) == blob


def test_the_cache_survives_a_restart(tmp_path: Path, blob: bytes) -> None:
    layer = _layer(blob)
    store = _store(tmp_path, layer, blob)
    r = _reader(tmp_path, layer, store)
    r.read(0, len(blob))
    r.cache.close()
    again = _reader(tmp_path, layer, store)
    assert again.cache.bytes >= len(blob) - 100
    assert again.read(0, len(blob)) == blob
    assert again.stats.fetched_bytes == 0


def test_corrupt_cache_is_detected_and_refetched(tmp_path: Path, blob: bytes) -> None:
    layer = _layer(blob)
    r = _reader(tmp_path, layer, _store(tmp_path, layer, blob), readahead=1)
    r.read(0, CS)
    data_file = tmp_path / "cache" / (layer.blob_digest.removeprefix("sha256:") + ".data")
    with open(data_file, "r+b") as f:
        f.write(b"\xff" * 16)
    assert r.read(0, CS) == blob[:CS]
    assert r.stats.corrupt_chunks == 1 and r.stats.fetched_chunks == 2


def test_a_corrupt_store_fails_the_read_after_refetching(tmp_path: Path, blob: bytes) -> None:
    layer = _layer(blob)
    bad = bytearray(blob)
    bad[5] ^= 0xFF
    r = _reader(tmp_path, layer, _store(tmp_path, layer, bytes(bad)), readahead=1)
    with pytest.raises(Unavailable, match="fails its digest"):
        r.read(0, 10)
    assert r.stats.corrupt_chunks == 4 and r.stats.failed_reads == 1
    assert r.read(CS, 10) == blob[CS : CS + 10]  # other chunks still fine


class FlakyStore:
    """A store that fails the first `fails` calls, then serves (a seam)."""

    def __init__(self, inner: LocalObjects, fails: int, delay: float = 0.0) -> None:
        self.inner, self.fails, self.delay, self.calls = inner, fails, delay, 0
        self.url = f"flaky://{id(self)}"  # the breaker is per store

    def get_range(self, key: str, offset: int, length: int, timeout: float | None = None) -> bytes:
        self.calls += 1
        time.sleep(self.delay)
        if self.calls <= self.fails:
            raise ConnectionError("store down")
        return self.inner.get_range(key, offset, length)


def test_a_flaky_store_is_retried(tmp_path: Path, blob: bytes) -> None:
    layer = _layer(blob)
    flaky = FlakyStore(_store(tmp_path, layer, blob), fails=2)
    r = _reader(tmp_path, layer, flaky, attempts=4, deadline=5)
    assert r.read(0, 10) == blob[:10]
    assert flaky.calls == 3


def test_a_dead_store_fails_within_the_deadline(tmp_path: Path, blob: bytes) -> None:
    layer = _layer(blob)
    dead = FlakyStore(_store(tmp_path, layer, blob), fails=10**9, delay=0.1)
    r = _reader(tmp_path, layer, dead, attempts=100, deadline=1.0)
    t0 = time.monotonic()
    with pytest.raises(Unavailable, match="gave up"):
        r.read(0, 10)
    assert time.monotonic() - t0 < 3.0


def test_concurrent_readers_of_one_chunk_fetch_it_once(tmp_path: Path, blob: bytes) -> None:
    layer = _layer(blob)
    slow = FlakyStore(_store(tmp_path, layer, blob), fails=0, delay=0.2)
    r = _reader(tmp_path, layer, slow, readahead=1)
    out: list[bytes] = []
    threads = [threading.Thread(target=lambda: out.append(r.read(100, 10))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == [blob[100:110]] * 8 and slow.calls == 1


def test_cache_evicts_least_recently_used_unpinned_first(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, max_bytes=10 * CS)
    for i in range(8):
        cache.put("old", 40 * CS, CS, i, b"o" * CS, pinned=set())
    for i in range(8):
        cache.put("hot", 40 * CS, CS, i, b"h" * CS, pinned={"hot"})
    # Over the bound: "old" (not pinned) lost chunks, "hot" kept them all.
    assert cache.bytes <= 10 * CS
    assert all(cache.get("hot", 40 * CS, CS, i, CS) == b"h" * CS for i in range(8))
    assert sum(cache.get("old", 40 * CS, CS, i, CS) is not None for i in range(8)) < 8
    assert cache.evicted > 0


def test_missing_objects_and_bad_keys(tmp_path: Path) -> None:
    store = LocalObjects(tmp_path)
    with pytest.raises(NotFound):
        store.get("blobs/sha256/nope")
    with pytest.raises(Exception, match="without"):
        store.get("../etc/passwd")
