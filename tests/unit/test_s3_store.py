"""The S3 backend against an S3-compatible server on loopback (moto's
server: the S3 HTTP API, no AWS account needed)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.errors import NotFound
from corral.images import registry
from corral.images.objects import open_store
from corral.images.store import ImageStore


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for key, value in {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "CORRAL_S3_ENDPOINT": endpoint,
    }.items():
        monkeypatch.setenv(key, value)
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="layers")
    yield "s3://layers/corral"
    server.stop()


def test_s3_objects_and_ranges(s3: str) -> None:
    store = open_store(s3)
    store.put_bytes("blobs/sha256/x", b"0123456789")
    assert store.get_range("blobs/sha256/x", 2, 3) == b"234"
    assert store.size("blobs/sha256/x") == 10 and store.exists("blobs/sha256/x")
    assert store.list("blobs") == ["blobs/sha256/x"]
    with pytest.raises(NotFound):
        store.get("blobs/sha256/nope")


def test_push_and_pull_through_s3(s3: str, tmp_path: Path) -> None:
    a, b = ImageStore(tmp_path / "a"), ImageStore(tmp_path / "b")
    (tmp_path / "meta.in").write_bytes(b"m" * 10)
    (tmp_path / "blob.in").write_bytes(b"b" * 100_000)
    layer = a.add(tmp_path / "meta.in", tmp_path / "blob.in", chunk_size=4096, tag="s3t:1")
    registry.push(a, "s3t:1", open_store(s3), lambda *_: None)
    got = registry.pull(b, "s3t:1", open_store(s3), lambda *_: None, eager=True)
    assert got.digest == layer.digest
    assert b.blob_path(layer.blob_digest).read_bytes() == b"b" * 100_000
