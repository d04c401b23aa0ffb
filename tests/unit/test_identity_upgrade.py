"""A store written before layer identity 2 is brought up to it once, when
opened: every old layer gets a twin whose digest covers its whole manifest,
tags move to the twins, and the old layers stay for what names them by
digest (docs/layer-identity.md)."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from corral.images import upgrade
from corral.images.layer import IDENTITY, LEGACY, STACK, Layer
from corral.images.store import ImageStore

pytestmark = pytest.mark.unit


def _legacy_stack(root: Path) -> tuple[ImageStore, list[Layer]]:
    """A two-layer stack and a lone layer, as an older Corral wrote them:
    manifests without `identity`, digests under the old rule, tagged."""
    store = ImageStore(root)
    made = []
    parent = None
    for i, labels in enumerate(({STACK: "oci"}, {STACK: "oci"}, {"build.key": "k"})):
        (root / "m.in").write_bytes(b"m%d" % i * 100)
        (root / "b.in").write_bytes(b"b%d" % i * 9000)
        new = store.add(root / "m.in", root / "b.in", chunk_size=4096, labels=labels,
                        parent=parent if STACK in labels else None)  # fmt: skip
        (store.layers / f"{new.digest[7:]}.json").unlink()
        doc = {k: v for k, v in new.to_json().items() if k != "identity"}
        old = Layer.from_json(doc)
        old = replace(old, digest=old.expected_digest())
        doc["digest"] = old.digest
        (store.layers / f"{old.digest[7:]}.json").write_text(json.dumps(doc))
        made.append(old)
        parent = old.digest if i == 0 else parent
    store.tag(made[1].digest, "img:1")
    store.tag(made[2].digest, "tk:1")
    (root / upgrade.MARKER).unlink()
    return store, made


def test_an_old_store_gets_twins_and_its_tags_move_to_them(tmp_path: Path) -> None:
    _, (bottom, top, lone) = _legacy_stack(tmp_path)
    assert (bottom.identity, top.parent) == (LEGACY, bottom.digest)
    store = ImageStore(tmp_path)  # opening it upgrades it
    new_top = store.resolve("img:1")
    new_bottom = store.get(str(new_top.parent))
    assert new_top.identity == new_bottom.identity == IDENTITY
    assert new_bottom.digest != bottom.digest and new_top.digest != top.digest
    assert [x.digest for x in store.chain(new_top)] == [new_bottom.digest, new_top.digest]
    for twin, old in ((new_bottom, bottom), (new_top, top), (store.resolve("tk:1"), lone)):
        assert twin.expected_digest() == twin.digest
        assert (twin.blob_digest, twin.chunk_digests, twin.labels, twin.created) == (
            old.blob_digest, old.chunk_digests, old.labels, old.created)  # fmt: skip
        assert store.get(old.digest).identity == LEGACY  # still there, by its digest
    assert store.find_by_label("build.key", "k").digest == store.resolve("tk:1").digest  # type: ignore[union-attr]
    assert upgrade.upgrade(store) == 0  # once


def test_a_tag_moved_meanwhile_stays_where_it_was_put(tmp_path: Path) -> None:
    store, (_, top, lone) = _legacy_stack(tmp_path)
    store.tag(lone.digest, "img:1")  # retagged by someone else before the upgrade ran
    assert upgrade.upgrade(store) == 3
    assert store.resolve("img:1").digest != top.digest
    assert store.resolve("img:1").blob_digest == lone.blob_digest


def test_gc_keeps_an_old_layer_while_its_twin_is_kept(tmp_path: Path) -> None:
    """A saved state or a record may name the old digest: it resolves as
    long as the image does; once the twin goes, so does it."""
    _, (bottom, top, lone) = _legacy_stack(tmp_path)
    store = ImageStore(tmp_path)
    assert store.gc(in_use=set())[0] == 0
    assert store.get(top.digest).identity == store.get(bottom.digest).identity == LEGACY
    store.untag("tk:1")
    assert store.gc(in_use=set())[0] == 2  # the lone layer and its twin
    assert store.resolve("img:1").identity == IDENTITY
    assert not store.has_blob(lone.blob_digest) and store.has_blob(top.blob_digest)


def test_a_layer_read_lazily_from_a_store_keeps_its_old_identity(tmp_path: Path) -> None:
    """Its data is not here, so nothing vouches for its chunk list: it and
    the stack above it stay as they were, tags included."""
    _, (bottom, top, _) = _legacy_stack(tmp_path)
    os.unlink(tmp_path / "blobs" / "sha256" / bottom.blob_digest[7:])
    store = ImageStore(tmp_path)
    assert store.resolve("img:1").digest == top.digest
    assert store.resolve("tk:1").identity == IDENTITY
