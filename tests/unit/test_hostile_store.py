"""A blob store the node does not control (a damaged or hostile one) sends
manifests that still match their own digests: every field that becomes a
host path or sizes a map is held to its form before anything of it is
used, and no answer makes the node hold more than it asked for."""

from __future__ import annotations

import gzip
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from corral.errors import ImageNotFound, InvalidArgument, Unavailable
from corral.images import pull, registry
from corral.images.layer import IDENTITY, LEGACY, MAX_STACK, STACK, Layer
from corral.images.objects import HttpObjects, LocalObjects
from corral.images.store import ImageStore

pytestmark = pytest.mark.unit


def _noprogress(task: str, done: float, total: float | None) -> None:
    pass


def _pushed(tmp_path: Path) -> tuple[LocalObjects, str, dict[str, Any]]:
    a = ImageStore(tmp_path / "a")
    (tmp_path / "meta.in").write_bytes(b"meta" * 100)
    (tmp_path / "blob.in").write_bytes(bytes(range(256)) * 100)
    a.add(tmp_path / "meta.in", tmp_path / "blob.in", chunk_size=4096, kind="toolkit", tag="tk:1")
    remote = LocalObjects(tmp_path / "shared")
    registry.push(a, "tk:1", remote, _noprogress)
    digest = remote.get("tags/tk/1").decode().strip()
    return remote, digest, json.loads(remote.get(f"layers/{digest[7:]}.json"))


def _forge(remote: LocalObjects, doc: dict[str, Any]) -> None:
    """Store `doc` as tk:1's layer under the digest it claims to have: the
    one a hostile store would compute for it."""
    try:
        digest = Layer.from_json(doc).expected_digest()
    except ValueError:  # BadManifest: a digest it could not compute
        digest = "sha256:" + "e" * 64
    doc = {**doc, "digest": digest}
    remote.put_bytes(f"layers/{digest[7:]}.json", json.dumps(doc).encode())
    remote.put_bytes("tags/tk/1", digest.encode())


BAD: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]], str]] = [
    ("a device as the data", lambda d: {**d, "blob_digest": "sha256:/dev/sda"}, "blob_digest"),
    ("a path as the metadata", lambda d: {**d, "meta_digest": "sha256:../../etc/shadow"},
     "meta_digest"),
    ("upper-case hex", lambda d: {**d, "blob_digest": d["blob_digest"].upper()}, "blob_digest"),
    ("a parent that is a path", lambda d: {**d, "parent": "/etc"}, "parent"),
    ("chunks of no size", lambda d: {**d, "chunk_size": 0}, "chunk_size"),
    ("one-byte chunks", lambda d: {**d, "chunk_size": 1}, "chunk_size"),
    ("a petabyte blob", lambda d: {**d, "blob_size": 1 << 50}, "blob_size"),
    ("fewer chunk digests", lambda d: {**d, "chunk_digests": d["chunk_digests"][:-1]},
     "chunk_digests"),
    ("a chunk digest that is a path", lambda d: {**d, "chunk_digests": ["../x"] * len(
        d["chunk_digests"])}, "chunk_digests"),
    ("a field Corral does not know", lambda d: {**d, "exec": "sh"}, "not a layer manifest"),
    ("no config", lambda d: {k: v for k, v in d.items() if k != "config"}, "not a layer manifest"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "change", "named"), BAD, ids=[b[0] for b in BAD])
def test_a_forged_manifest_is_damaged_and_nothing_of_it_is_kept(
    tmp_path: Path, case: str, change: Callable[[dict[str, Any]], dict[str, Any]], named: str
) -> None:
    remote, _, doc = _pushed(tmp_path)
    _forge(remote, change(doc))
    local = ImageStore(tmp_path / "b")
    with pytest.raises(ImageNotFound, match="is damaged") as err:
        registry.pull(local, "tk:1", remote, _noprogress)
    assert named in str(err.value)
    assert local.list() == []


SWAPS: list[tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]] = [
    ("chunk digests", lambda d: {**d, "chunk_digests": ["0" * 64] * len(d["chunk_digests"])}),
    ("a label a pull's cache is found by", lambda d: {**d, "labels": {"oci.chain_id": "x"}}),
    ("kind", lambda d: {**d, "kind": "base"}),
    ("parent", lambda d: {**d, "parent": "sha256:" + "1" * 64}),
    ("content size", lambda d: {**d, "content_size": 1}),
    ("to the old identity", lambda d: {k: v for k, v in d.items() if k != "identity"}),
]  # fmt: skip


@pytest.mark.parametrize(("case", "change"), SWAPS, ids=[s[0] for s in SWAPS])
def test_a_store_can_change_nothing_under_a_layers_digest(
    tmp_path: Path, case: str, change: Callable[[dict[str, Any]], dict[str, Any]]
) -> None:
    """A pull by digest gets what was pushed or nothing: every field a node
    reads (chunk digests, labels, kind, parent, sizes) is in the digest."""
    remote, digest, doc = _pushed(tmp_path)
    assert doc["identity"] == IDENTITY
    remote.put_bytes(f"layers/{digest[7:]}.json", json.dumps(change(doc)).encode())
    local = ImageStore(tmp_path / "b")
    with pytest.raises(ImageNotFound, match="does not match its digest"):
        registry.pull(local, digest, remote, _noprogress)
    assert local.list() == []


def _legacy(remote: LocalObjects, doc: dict[str, Any]) -> str:
    """Store `doc` as a layer written before identity 2, under the digest
    that identity gives it (which covers neither chunk digests nor labels)."""
    doc = {k: v for k, v in doc.items() if k != "identity"}
    doc["digest"] = digest = Layer.from_json(doc).expected_digest()
    remote.put_bytes(f"layers/{digest[7:]}.json", json.dumps(doc).encode())
    return str(digest)


def test_an_old_layer_is_checked_whole_and_keeps_no_label_but_its_stack(tmp_path: Path) -> None:
    remote, _, doc = _pushed(tmp_path)
    digest = _legacy(remote, {**doc, "labels": {"oci.chain_id": "sha256:x", STACK: "oci"}})
    local = ImageStore(tmp_path / "b")
    layer = registry.pull(local, digest, remote, _noprogress)
    assert (layer.digest, layer.identity, layer.labels) == (digest, LEGACY, {STACK: "oci"})
    assert local.blob_path(layer.blob_digest).exists()  # fetched whole, not lazily
    assert local.origin(layer.digest) is None
    assert local.find_by_label("oci.chain_id", "sha256:x") is None


def test_an_old_layer_with_forged_chunk_digests_is_damaged(tmp_path: Path) -> None:
    """Under the old identity a store could swap the chunk digests (and
    serve chunks to match them); the whole blob, checked against the digest
    the identity does cover, says they are not its chunks."""
    remote, _, doc = _pushed(tmp_path)
    digest = _legacy(remote, {**doc, "chunk_digests": ["0" * 64] * len(doc["chunk_digests"])})
    local = ImageStore(tmp_path / "b")
    with pytest.raises(ImageNotFound, match="chunk digests or sizes are not its data's"):
        registry.pull(local, digest, remote, _noprogress)
    assert local.list() == []


@pytest.mark.parametrize("tag", ["sha256:/dev/sda", "../../x", "sha256:" + "A" * 64])
def test_a_tag_that_names_no_digest_is_damaged(tmp_path: Path, tag: str) -> None:
    remote, _, _ = _pushed(tmp_path)
    remote.put_bytes("tags/tk/1", tag.encode())
    with pytest.raises(ImageNotFound, match="a tag names"):
        registry.pull(ImageStore(tmp_path / "b"), "tk:1", remote, _noprogress)


def test_a_blob_path_is_never_one_a_manifest_chose(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "s")
    for bad in ("sha256:/dev/sda", "sha256:../x", "/dev/sda", ""):
        with pytest.raises(ValueError, match="not a blob digest"):
            store.blob_path(bad)


def test_a_local_object_past_its_limit_is_refused(tmp_path: Path) -> None:
    store = LocalObjects(tmp_path)
    store.put_bytes("tags/x/1", b"x" * 5000)
    with pytest.raises(Unavailable, match="larger than 4096 bytes"):
        store.get("tags/x/1", 4096)
    assert store.get("tags/x/1", 5000) == b"x" * 5000


@pytest.fixture
def flooding() -> Iterator[str]:
    """A blob store that answers every GET with 1 MiB, ranges ignored."""

    class Flood(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-length", str(1 << 20))
            self.end_headers()
            self.wfile.write(b"z" * (1 << 20))

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Flood)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    t.join(5)


def test_a_store_that_sends_more_than_asked_is_refused(flooding: str) -> None:
    store = HttpObjects(flooding)
    with pytest.raises(Unavailable, match="larger than 4096 bytes"):
        store.get("tags/x/1", 4096)
    with pytest.raises(Unavailable, match="more than the 10 bytes asked"):
        store.get_range("blobs/sha256/" + "a" * 64, 0, 10)
    assert len(store.get("tags/x/1")) == 1 << 20  # no limit asked: as before


# ------------------------------------------------------------ a registry's


def test_a_gzip_bomb_is_cut_at_the_layer_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registry chooses a layer's bytes until its diff_id is checked at
    the end: the unpacking stops at MAX_LAYER_BYTES."""
    monkeypatch.setattr(pull, "MAX_LAYER_BYTES", 1 << 20)
    bomb = tmp_path / "layer.tar.gz"
    with gzip.open(bomb, "wb") as f:
        f.write(b"\0" * (16 << 20))
    with pytest.raises(InvalidArgument, match="larger than 1048576 bytes unpacked"):
        pull._plain_tar(bomb, "application/vnd.oci.image.layer.v1.tar+gzip", "sha256:" + "0" * 64,
                        tmp_path / "out.tar")  # fmt: skip
    assert (tmp_path / "out.tar").stat().st_size <= (1 << 20) + (1 << 20)


def test_an_image_of_too_many_layers_is_refused_before_any_is_unpacked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = MAX_STACK
    manifest = {"layers": [{"digest": "sha256:" + "1" * 64}] * n}
    config = {"rootfs": {"diff_ids": ["sha256:" + "2" * 64] * n}}
    monkeypatch.setattr(pull, "_copy", lambda *a, **k: None)
    monkeypatch.setattr(pull, "_manifest", lambda *a: ("sha256:" + "3" * 64, manifest, config))

    def never(*a: Any, **k: Any) -> None:
        raise AssertionError("a layer was unpacked")

    monkeypatch.setattr(pull, "_convert", never)
    with pytest.raises(InvalidArgument, match=f"more than {MAX_STACK - 1} layers"):
        pull.pull(ImageStore(tmp_path / "s"), "registry.example/x:1", _noprogress)


@pytest.mark.parametrize("digest", ["sha256:" + "a" * 63 + "/", "sha256:../../../../etc/x", 7])
def test_an_oci_descriptor_digest_is_never_a_path(tmp_path: Path, digest: Any) -> None:
    with pytest.raises(InvalidArgument, match="not sha256"):
        pull._blob(tmp_path, digest)
