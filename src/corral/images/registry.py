"""Moving layers between the node's store and a shared one (push, pull).

A pull copies only the tag and the manifest: the metadata image comes at
first mount and the data blob chunk by chunk as sandboxes read it (the
layer remembers its origin).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace

from corral.errors import ImageNotFound, NotFound
from corral.images.layer import DIGEST, LEGACY, MAX_STACK, STACK, Layer, Ref
from corral.images.objects import ObjectStore
from corral.images.store import ImageStore, ProgressFn, hash_file

# A layer's manifest lists a digest per chunk: 64 KiB chunks of a 64 GiB
# layer make about 70 MB of it.
MAX_MANIFEST = 128 << 20


def _hex(digest: str) -> str:
    return digest.removeprefix("sha256:")


def push(local: ImageStore, ref: str, remote: ObjectStore, progress: ProgressFn) -> Layer:
    """Copy a layer (an image stack: every layer of it) to the store."""
    top = local.resolve(ref)
    chain = local.chain(top)
    label = f"push {ref}"
    parts = [d for layer in chain for d in (layer.meta_digest, layer.blob_digest)]
    for i, digest in enumerate(parts):
        progress(label, i, len(parts) + 1)
        key = f"blobs/sha256/{_hex(digest)}"
        if not remote.exists(key):
            path = local.blob_path(digest)
            if not path.exists():
                raise ImageNotFound(
                    f"{ref}: its blob {digest} is not on this node (pulled lazily?); "
                    "push from a node that built it"
                )
            remote.put_file(key, path)
    for layer in chain:  # bottom first: a reader never finds a top without its base
        remote.put_bytes(f"layers/{_hex(layer.digest)}.json", json.dumps(layer.to_json()).encode())
    parsed = Ref.parse(ref)
    if parsed.name:
        remote.put_bytes(f"tags/{parsed.name}/{parsed.tag}", top.digest.encode())
    progress(label, len(parts) + 1, len(parts) + 1)
    return top


def _download(
    local: ImageStore, remote: ObjectStore, digest: str, progress: ProgressFn, label: str
) -> None:
    """Fetch a whole blob into the local store, verifying its digest."""
    dst = local.blob_path(digest)
    if dst.exists():
        return
    key = f"blobs/sha256/{_hex(digest)}"
    size = remote.size(key)
    tmp = local.tmpdir("pull") / "blob"
    h = hashlib.sha256()
    step = 8 << 20
    with open(tmp, "wb") as f:
        for off in range(0, size, step):
            data = remote.get_range(key, off, min(step, size - off))
            h.update(data)
            f.write(data)
            progress(label, off + len(data), size)
    if "sha256:" + h.hexdigest() != digest:
        tmp.unlink()
        raise ImageNotFound(f"blob {digest} from {remote.url} does not match its digest")
    os.chmod(tmp, 0o444)
    os.replace(tmp, dst)
    tmp.parent.rmdir()


def _manifest(remote: ObjectStore, digest: str, ref: str) -> Layer:
    """The manifest of layer `digest` in `remote`, held to its rules."""
    damaged = f"{ref} in {remote.url} is damaged"
    if not DIGEST.fullmatch(digest):
        raise ImageNotFound(f"{damaged}: a tag names {digest[:80]!r}, not a digest", ref=ref)
    try:
        doc = json.loads(remote.get(f"layers/{_hex(digest)}.json", MAX_MANIFEST))
        return Layer.from_json(doc)
    except (ValueError, UnicodeDecodeError) as exc:  # BadManifest, or not JSON at all
        raise ImageNotFound(f"{damaged}: {exc}", ref=ref) from None


def _vouch_legacy(
    local: ImageStore, remote: ObjectStore, layer: Layer, progress: ProgressFn, ref: str
) -> Layer:
    """A LEGACY layer checked as its digest cannot: its digest covers the
    blob whole but not the chunk digests a lazy read checks against, so the
    blob is fetched whole (its digest checked) and every chunk's digest
    recomputed; and it does not cover labels, so the only label kept is
    STACK (which it covers). Lookups by label (a pull's or a build's cache)
    then never take it, which costs at most a rebuild."""
    _download(local, remote, layer.meta_digest, progress, f"download {ref} metadata")
    _download(local, remote, layer.blob_digest, progress, f"download {ref} data")
    meta, blob = local.blob_path(layer.meta_digest), local.blob_path(layer.blob_digest)
    _, chunks = hash_file(blob, layer.chunk_size)
    if (chunks != layer.chunk_digests or blob.stat().st_size != layer.blob_size
            or meta.stat().st_size != layer.meta_size):  # fmt: skip
        raise ImageNotFound(
            f"{ref} in {remote.url} is damaged: layer {layer.digest}'s chunk digests or sizes "
            "are not its data's",
            ref=ref,
        )
    kept = {STACK: layer.labels[STACK]} if STACK in layer.labels else {}
    return replace(layer, labels=kept)


def pull(
    local: ImageStore, ref: str, remote: ObjectStore, progress: ProgressFn, *, eager: bool = False
) -> Layer:
    """Register a layer; with eager, also download its metadata and data now
    (as a classic image pull does) instead of on first read."""
    parsed = Ref.parse(ref)
    label = f"pull {ref}"
    progress(label, 0, 2)
    try:
        digest = (
            parsed.digest or remote.get(f"tags/{parsed.name}/{parsed.tag}", 4096).decode().strip()
        )
        top = _manifest(remote, digest, ref)
    except ImageNotFound:
        raise  # damaged: said as such (it is a NotFound too)
    except NotFound:
        raise ImageNotFound(f"{ref} is not in {remote.url}", ref=ref) from None
    chain = [top]
    while chain[0].labels.get(STACK) and chain[0].parent:  # an image stack: all of it
        if len(chain) > MAX_STACK:
            raise ImageNotFound(f"{ref} in {remote.url}: a stack of more than {MAX_STACK}")
        try:
            chain.insert(0, _manifest(remote, chain[0].parent, ref))
        except ImageNotFound:
            raise
        except NotFound:
            raise ImageNotFound(f"{ref} in {remote.url}: a layer under it is missing") from None
    for layer in chain:
        if layer.expected_digest() != layer.digest:
            raise ImageNotFound(f"{ref} in {remote.url}: manifest does not match its digest")
    # Every layer checked before any is stored: nothing of a stack that
    # fails stays.
    chain = [
        _vouch_legacy(local, remote, x, progress, ref) if x.identity == LEGACY else x for x in chain
    ]
    for layer in chain:  # bottom first, as they are used
        local.put_manifest(layer)
        if eager:
            _download(local, remote, layer.meta_digest, progress, f"download {ref} metadata")
            _download(local, remote, layer.blob_digest, progress, f"download {ref} data")
        if not local.blob_path(layer.blob_digest).exists():
            local.set_origin(layer.digest, remote.url)
    if parsed.name:
        local.tag(top.digest, f"{parsed.name}:{parsed.tag}")
    progress(label, 2, 2)
    return local.get(top.digest)
