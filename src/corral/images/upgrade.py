"""A store written before layer identity 2, brought up to it once.

Every LEGACY layer whose data is on the node gets an IDENTITY twin: the
same blobs under a digest that covers its whole manifest
(docs/layer-identity.md), its stack's parent the twin of its old parent.
Tags move to the twins, so what a store pushes or serves from now on is
checkable chunk by chunk. The LEGACY manifests stay: sandbox records, saved
states and templates name layers by digest, and this node trusts its own
disk; gc keeps each while its twin is kept.

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

from corral.errors import CorralError
from corral.images.layer import IDENTITY, LEGACY, STACK, Layer
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
    def has_blob(self, digest: str) -> bool: ...


def upgrade(store: ImageStore) -> int:
    """Twin every LEGACY layer of `store` that can be and move its tags; the
    number of layers twinned (0 once done)."""
    marker = store.root / MARKER
    if _done(marker):
        return 0
    with open(store.root / f".{MARKER}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _done(marker):
            return 0
        old = {layer.digest: layer for layer in store.list() if layer.identity == LEGACY}
        twins: dict[str, str | None] = {}
        for digest in old:
            _twin_line(store, old, twins, digest)
        for digest, names in store.tag_map().items():
            twin = twins.get(digest)
            if twin is None:
                continue
            for name in names:
                try:
                    store.retag(name, digest, twin)
                except (OSError, ValueError, CorralError) as exc:  # one bad tag: the rest move
                    log.warning("image.retag_failed", name=name, error=str(exc)[:200])
        tmp = marker.with_name(f".{MARKER}.tmp")
        tmp.write_text(f"{IDENTITY}\n")
        tmp.replace(marker)
    made = sum(1 for t in twins.values() if t)
    if twins:
        log.info("image.identity_upgraded", store=str(store.root), layers=made,
                 kept_old=len(twins) - made)  # fmt: skip
    return made


def _done(marker: Path) -> bool:
    try:
        return int(marker.read_text()) >= IDENTITY
    except (OSError, ValueError):
        return False


def _twin_line(
    store: ImageStore, old: dict[str, Layer], twins: dict[str, str | None], digest: str
) -> None:
    """Twin LEGACY layer `digest` and its LEGACY ancestors, oldest first
    (twins[d]: d's twin, or None where d stays as it is).

    A layer is twinned only where both its images are on this node: then
    what it serves is its own bytes, whatever its chunk digests say (a
    wrong list breaks reads, it cannot change them). A layer read lazily
    from a store (no local data) keeps its old identity, and a stack with
    one such layer keeps it whole: another node checks it whole (registry.pull).
    """
    line: list[str] = []  # child first
    at: str | None = digest
    while at is not None and at in old and at not in twins and at not in line:
        line.append(at)
        at = old[at].parent
    for d in reversed(line):
        layer = old[d]
        parent = layer.parent
        stacked = bool(layer.labels.get(STACK)) and parent is not None
        if parent in twins:
            parent = twins[parent] or (None if stacked else parent)
        here = store.has_blob(layer.meta_digest) and store.has_blob(layer.blob_digest)
        if not here or (stacked and parent is None):
            twins[d] = None
            continue
        twin = replace(layer, parent=parent, names=[]).identified()
        store.put_manifest(twin)
        twins[d] = twin.digest
