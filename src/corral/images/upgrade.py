"""A store written before layer identity 2, brought up to it once.

Every LEGACY layer gets an IDENTITY twin: the same blobs under a digest
that covers its whole manifest (docs/layer-identity.md), its stack's parent
the twin of its old parent. Tags move to the twins, so what a store pushes
or serves from now on is checkable chunk by chunk. The LEGACY manifests
stay: sandbox records, saved states and templates name layers by digest,
and this node trusts its own disk; gc drops them once nothing uses them.

Runs when a store is opened (ImageStore), once: a marker file says it is
done, and a lock keeps two processes opening the same store from doing it
at once. Idempotent: a twin's digest is a function of its manifest, and a
tag moves only while it still names the old layer.
"""

from __future__ import annotations

import builtins
import fcntl
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from corral.images.layer import IDENTITY, LEGACY, Layer
from corral.log import get_logger

log = get_logger("corral.images")
MARKER = "identity"


class ImageStore(Protocol):
    """What this needs of images/store.py's ImageStore (which calls it)."""

    root: Path

    def list(self) -> builtins.list[Layer]: ...
    def tag_map(self) -> dict[str, builtins.list[str]]: ...
    def retag(self, name: str, was: str, digest: str) -> None: ...
    def put_manifest(self, layer: Layer) -> None: ...


def upgrade(store: ImageStore) -> int:
    """Twin every LEGACY layer of `store` and move its tags; the number of
    layers twinned (0 once done)."""
    marker = store.root / MARKER
    if _done(marker):
        return 0
    with open(store.root / f".{MARKER}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _done(marker):
            return 0
        old = {layer.digest: layer for layer in store.list() if layer.identity == LEGACY}
        twins: dict[str, str] = {}
        for digest in old:
            _twin(store, old, twins, digest)
        for digest, names in store.tag_map().items():
            if digest in twins:
                for name in names:
                    store.retag(name, digest, twins[digest])
        tmp = marker.with_name(f".{MARKER}.tmp")
        tmp.write_text(f"{IDENTITY}\n")
        tmp.replace(marker)
    if twins:
        log.info("image.identity_upgraded", store=str(store.root), layers=len(twins))
    return len(twins)


def _done(marker: Path) -> bool:
    try:
        return int(marker.read_text()) >= IDENTITY
    except (OSError, ValueError):
        return False


def _twin(store: ImageStore, old: dict[str, Layer], twins: dict[str, str], digest: str) -> str:
    """The IDENTITY twin of LEGACY layer `digest`, written; its parent's
    first. Parents are older than their children, so the recursion ends; a
    parent named twice on one line (a damaged store) keeps its old digest."""
    if digest in twins:
        return twins[digest]
    twins[digest] = digest  # while its parents are twinned
    layer = old[digest]
    parent = layer.parent
    if parent in old:
        parent = _twin(store, old, twins, parent)
    twin = replace(layer, parent=parent, names=[]).identified()
    store.put_manifest(twin)
    twins[digest] = twin.digest
    return twin.digest
