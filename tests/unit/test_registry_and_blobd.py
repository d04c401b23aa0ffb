"""Push/pull between stores, the HTTP blob store (real loopback server),
and reading OCI / docker archives."""

from __future__ import annotations

import io
import json
import socket
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from corral.errors import ImageNotFound, InvalidArgument, NotFound, Unavailable
from corral.images import registry
from corral.images.blobd import create_blob_app
from corral.images.objects import HttpObjects, LocalObjects, open_store
from corral.images.oci import read_archive
from corral.images.store import ImageStore


def _noprogress(task: str, done: float, total: float | None) -> None:
    pass


def _layer(store: ImageStore, tmp: Path, tag: str) -> str:
    (tmp / "meta.in").write_bytes(b"meta" * 100)
    (tmp / "blob.in").write_bytes(bytes(range(256)) * 1000)
    return store.add(
        tmp / "meta.in", tmp / "blob.in", chunk_size=4096, kind="toolkit", tag=tag
    ).digest


def test_push_then_pull_registers_the_layer_lazily(tmp_path: Path) -> None:
    a, b = ImageStore(tmp_path / "a"), ImageStore(tmp_path / "b")
    digest = _layer(a, tmp_path, "tk:1")
    remote = LocalObjects(tmp_path / "shared")
    registry.push(a, "tk:1", remote, _noprogress)
    got = registry.pull(b, "tk:1", remote, _noprogress)
    assert got.digest == digest and got.names == ["tk:1"]
    assert b.origin(digest) == str(tmp_path / "shared")
    assert not b.blob_path(got.blob_digest).exists()  # data stays remote until read
    with pytest.raises(ImageNotFound):
        registry.pull(b, "tk:2", remote, _noprogress)


def test_a_manifest_that_lies_about_its_digest_is_refused(tmp_path: Path) -> None:
    a, b = ImageStore(tmp_path / "a"), ImageStore(tmp_path / "b")
    digest = _layer(a, tmp_path, "tk:1")
    remote = LocalObjects(tmp_path / "shared")
    registry.push(a, "tk:1", remote, _noprogress)
    key = f"layers/{digest.removeprefix('sha256:')}.json"
    doc = json.loads(remote.get(key))
    doc["blob_digest"] = "sha256:" + "f" * 64
    remote.put_bytes(key, json.dumps(doc).encode())
    with pytest.raises(ImageNotFound, match="does not match"):
        registry.pull(b, "tk:1", remote, _noprogress)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def blobd(tmp_path: Path) -> Iterator[str]:
    root = tmp_path / "served"
    root.mkdir()
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_blob_app(root, api_key="k"),
            host="127.0.0.1",
            port=port,
            log_level="error",
            lifespan="off",
        )
    )
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    t.join(5)


def test_http_store_ranges_put_and_list(blobd: str) -> None:
    store = HttpObjects(blobd, api_key="k")
    store.put_bytes("blobs/sha256/abc", b"0123456789")
    assert store.get("blobs/sha256/abc") == b"0123456789"
    assert store.get_range("blobs/sha256/abc", 3, 4) == b"3456"
    assert store.size("blobs/sha256/abc") == 10
    assert store.list("blobs") == ["blobs/sha256/abc"]
    with pytest.raises(NotFound):
        store.get("blobs/sha256/missing")
    assert not store.exists("blobs/sha256/missing")
    anonymous = HttpObjects(blobd)
    with pytest.raises(Exception, match="refused"):
        anonymous.put_bytes("blobs/sha256/x", b"x")


def test_push_and_pull_over_http(tmp_path: Path, blobd: str) -> None:
    a, b = ImageStore(tmp_path / "a"), ImageStore(tmp_path / "b")
    digest = _layer(a, tmp_path, "tk:9")
    registry.push(a, "tk:9", HttpObjects(blobd, api_key="k"), _noprogress)
    # Reads need the key too (issue 14): a layer store is not for anyone.
    with pytest.raises(Unavailable, match="401"):
        registry.pull(b, "tk:9", open_store(blobd), _noprogress)
    assert registry.pull(b, "tk:9", open_store(blobd, "k"), _noprogress).digest == digest


@pytest.mark.parametrize("url", ["relative/dir", "ftp://x", ""])
def test_bad_store_urls(url: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        open_store(url)
    assert exc.value.field == "store"


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_read_oci_layout_and_docker_save(tmp_path: Path) -> None:
    import hashlib

    oci = tmp_path / "oci"
    (oci / "blobs" / "sha256").mkdir(parents=True)

    def blob(data: bytes) -> str:
        h = hashlib.sha256(data).hexdigest()
        (oci / "blobs" / "sha256" / h).write_bytes(data)
        return "sha256:" + h

    l1, l2 = blob(_tar({"a": b"1"})), blob(_tar({"b": b"2"}))
    cfg = blob(json.dumps({"config": {"Env": ["A=1"], "WorkingDir": "/w"}}).encode())
    man = blob(
        json.dumps(
            {
                "config": {"digest": cfg},
                "layers": [
                    {"digest": l1, "mediaType": "application/vnd.oci.image.layer.v1.tar"},
                    {"digest": l2, "mediaType": "application/vnd.oci.image.layer.v1.tar"},
                ],
            }
        ).encode()
    )
    (oci / "index.json").write_text(json.dumps({"manifests": [{"digest": man}]}))
    (oci / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    archive = read_archive(oci)
    assert [p.name for p in archive.layers] == [l1[7:], l2[7:]]
    assert archive.config["config"]["WorkingDir"] == "/w"

    docker = tmp_path / "docker"
    (docker / "x").mkdir(parents=True)
    (docker / "x" / "layer.tar").write_bytes(_tar({"c": b"3"}))
    (docker / "cfg.json").write_text(json.dumps({"config": {"User": "1000"}}))
    (docker / "manifest.json").write_text(
        json.dumps([{"Config": "cfg.json", "Layers": ["x/layer.tar"]}])
    )
    archive = read_archive(docker)
    assert archive.layers == [(docker / "x" / "layer.tar").resolve()]
    assert archive.config["config"]["User"] == "1000"

    (docker / "manifest.json").write_text(
        json.dumps([{"Config": "../../etc/passwd", "Layers": []}])
    )
    with pytest.raises(InvalidArgument, match="outside"):
        read_archive(docker)
    with pytest.raises(InvalidArgument, match="OCI image layout"):
        read_archive(tmp_path / "nothing-here")


async def test_a_nodes_layer_store_is_served_read_only_its_layers_alone(tmp_path: Path) -> None:
    """A node serves its live layer store to its peers (server.py): never
    its origins (which say where the operator's key is sent), work trees or
    pulled OCI trees, nothing through a link an image planted, and no
    write (a peer holding the nodes' key must not rewrite what it mounts)."""
    import httpx

    from corral.server import NODE_BLOBS

    root = tmp_path / "images"
    (root / "blobs" / "sha256").mkdir(parents=True)
    (root / "blobs" / "sha256" / "ab").write_bytes(b"layer")
    (root / "origins").mkdir()
    (root / "origins" / "ab").write_text("https://store.example")
    (root / "tmp" / "pull-1" / "upper").mkdir(parents=True)
    (root / "tmp" / "pull-1" / "upper" / "shadow").symlink_to("/etc/passwd")
    (root / "tags" / "x").mkdir(parents=True)
    (root / "tags" / "x" / "1").symlink_to("/etc/hostname")  # a link inside a served tree
    app = create_blob_app(root, api_key="k", serves=NODE_BLOBS)
    key = {"authorization": "Bearer k"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
        assert (await h.get("/objects/blobs/sha256/ab", headers=key)).content == b"layer"
        for hidden in ("origins/ab", "tmp/pull-1/upper/shadow", "tags/x/1"):
            assert (await h.get(f"/objects/{hidden}", headers=key)).status_code == 404, hidden
            assert (await h.head(f"/objects/{hidden}", headers=key)).status_code == 404, hidden
        put = await h.put("/objects/layers/ab.json", headers=key, content=b"{}")
        assert put.status_code == 405 and not (root / "layers").exists()
        listed = (await h.get("/objects", headers=key)).json()["keys"]
        assert listed == ["blobs/sha256/ab"]
