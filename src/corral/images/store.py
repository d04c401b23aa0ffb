"""The node's local layer store: content-addressed blobs, manifests, tags.

    <root>/blobs/sha256/<hex>      metadata images and data blobs
    <root>/layers/<hex>.json       one manifest per layer
    <root>/tags/<name>/<tag>       a file holding the digest it points to

Every write is a rename of a complete temporary file, so a crash leaves
either the old state or the new one, plus temporary files gc removes.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from corral import labels as platform_labels
from corral.errors import Conflict, CorralError, ImageNotFound, InvalidArgument
from corral.images.layer import (
    DIGEST,
    IDENTITY,
    LAYER_KINDS,
    LEGACY,
    MAX_STACK,
    STACK,
    ImageConfig,
    Layer,
    Ref,
)
from corral.images.upgrade import upgrade
from corral.log import get_logger

log = get_logger("corral.images")
# A placeholder digest for a layer whose own is computed from it (Layer.identified).
UNNAMED = "sha256:" + "0" * 64
SOURCE = "corral.source"  # what made a layer: "commit:<sandbox>" for a commit

ProgressFn = Callable[[str, float, float | None], None]


def _gc_view(doc: dict[str, object]) -> tuple[tuple[str, str], bool]:
    """A manifest's (metadata image, data blob) digests, and whether it is LEGACY."""
    return (str(doc["meta_digest"]), str(doc["blob_digest"])), doc.get("identity", LEGACY) == LEGACY


@functools.lru_cache(maxsize=64)
def _read_layer(path: str, ino: int, mtime_ns: int) -> Layer:
    """A layer's manifest, parsed once per version of its file: its chunk
    list makes it ~180 KB of JSON for a Debian root, 0.18 ms to parse on
    every create. A manifest is written once (put_manifest) and replaced
    only whole, so (inode, mtime) names its content; a removed one is not
    found by the stat before. Callers must not change what it returns
    (Layer is frozen; its lists are shared)."""
    with open(path) as f:
        return Layer.from_json(json.load(f), [])


def hash_file(path: Path, chunk_size: int | None = None) -> tuple[str, list[str]]:
    """sha256 of the whole file and, if chunk_size, of each chunk."""
    whole = hashlib.sha256()
    chunks: list[str] = []
    with open(path, "rb") as f:
        while block := f.read(chunk_size or 1 << 20):
            whole.update(block)
            if chunk_size:
                chunks.append(hashlib.sha256(block).hexdigest())
    return "sha256:" + whole.hexdigest(), chunks


class ImageStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.blobs = root / "blobs" / "sha256"
        self.layers = root / "layers"
        self.tags = root / "tags"
        self.tmp = root / "tmp"
        self.origins = root / "origins"
        for d in (self.blobs, self.layers, self.tags, self.tmp, self.origins):
            d.mkdir(parents=True, exist_ok=True)
        self._inventory: tuple[int, dict[str, tuple[str, int]]] | None = None
        try:
            upgrade(self)
        except (OSError, ValueError, CorralError) as exc:  # read-only, or damaged: used as it is
            log.warning("image.identity_not_upgraded", store=str(root), error=str(exc)[:200])

    # ------------------------------------------------------------- blobs

    def blob_path(self, digest: str) -> Path:
        # Never a path a manifest chose ("sha256:/dev/sda"): Layer checks
        # its digests, and this is the last door.
        if not DIGEST.fullmatch(digest):
            raise ValueError(f"not a blob digest: {digest[:80]!r}")
        return self.blobs / digest.removeprefix("sha256:")

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).exists()

    def _put_blob(self, src: Path, digest: str) -> None:
        dst = self.blob_path(digest)
        if dst.exists():
            src.unlink()
            return
        os.chmod(src, 0o444)
        os.replace(src, dst)

    def tmpdir(self, prefix: str) -> Path:
        path = self.tmp / f"{prefix}-{os.getpid()}-{time.monotonic_ns()}"
        path.mkdir(parents=True)
        return path

    def origin(self, digest: str) -> str | None:
        """The store a pulled layer's blob is fetched from (None: local)."""
        try:
            return (self.origins / digest.removeprefix("sha256:")).read_text().strip()
        except FileNotFoundError:
            return None

    def set_origin(self, digest: str, url: str) -> None:
        path = self.origins / digest.removeprefix("sha256:")
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(url)
        os.replace(tmp, path)

    # ------------------------------------------------------------- layers

    def add(
        self,
        meta: Path,
        blob: Path,
        *,
        chunk_size: int,
        kind: str = "layer",
        config: ImageConfig | None = None,
        parent: str | None = None,
        labels: dict[str, str] | None = None,
        content_size: int = 0,
        tag: str | None = None,
    ) -> Layer:
        """Adopt a (metadata image, data blob) pair built by mkfs.erofs."""
        if kind not in LAYER_KINDS:
            raise InvalidArgument("kind", f"must be one of {', '.join(LAYER_KINDS)}", kind)
        config = config or ImageConfig()
        meta_digest, _ = hash_file(meta)
        blob_digest, chunk_digests = hash_file(blob, chunk_size)
        layer = Layer(
            digest=UNNAMED,
            kind=kind,
            meta_digest=meta_digest,
            meta_size=meta.stat().st_size,
            blob_digest=blob_digest,
            blob_size=blob.stat().st_size,
            chunk_size=chunk_size,
            chunk_digests=chunk_digests,
            content_size=content_size,
            config=config,
            created=time.time(),
            parent=parent,
            labels=dict(labels or {}),
        ).identified()
        digest = layer.digest
        self._put_blob(meta, meta_digest)
        self._put_blob(blob, blob_digest)
        self.put_manifest(layer)
        if tag:
            self.tag(digest, tag)
        return self.get(digest)

    def put_manifest(self, layer: Layer) -> None:
        path = self.layers / (layer.digest.removeprefix("sha256:") + ".json")
        if path.exists():
            return
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(layer.to_json()))
        os.replace(tmp, path)

    def get(self, digest: str, *, names: bool = True) -> Layer:
        """The layer `digest`; with `names`, the tags it carries, which
        costs a walk of every tag (a create's path passes names=False)."""
        path = self.layers / (digest.removeprefix("sha256:") + ".json")
        try:
            st = os.stat(path)
            layer = _read_layer(str(path), st.st_ino, st.st_mtime_ns)
        except FileNotFoundError:
            raise ImageNotFound(f"layer {digest} is not in this node's store", ref=digest) from None
        return replace(layer, names=self._names_of(digest)) if names else layer

    def resolve(self, text: str, field: str = "image", *, names: bool = True) -> Layer:
        return self.get(self.digest_of(text, field), names=names)

    def digest_of(self, text: str, field: str = "image") -> str:
        """The digest `text` names, checked to be in the store: what
        resolve() does less reading every tag for the layer's names (a hot
        path's check, such as a function call's image)."""
        ref = Ref.parse(text, field)
        if ref.digest:
            digest = ref.digest
        else:
            path = self.tags / str(ref.name) / str(ref.tag)
            try:
                digest = path.read_text().strip()
            except FileNotFoundError:
                raise ImageNotFound(
                    f"{field} '{ref}' not found on this node; `corral image ls` lists what it has",
                    field=field,
                    ref=str(ref),
                ) from None
        if not (self.layers / (digest.removeprefix("sha256:") + ".json")).exists():
            raise ImageNotFound(
                f"layer {digest} is not in this node's store", field=field, ref=digest
            )
        return digest

    def for_project(
        self, layer: Layer, project: str | None, field: str, *, by_name: bool = False
    ) -> Layer:
        """`layer`, if `project` may run on it: a layer a project committed
        through a gateway (labelled labels.PROJECT by the node) is that
        project's alone, every other the operator's; `project` None is a
        caller that owns the node (embedded). Another project's answers as
        a layer this node lacks, word for word, so that a digest learned
        elsewhere reads nothing. `by_name` (a layer named by its digest):
        an unlabelled commit whose every name is under another project's
        (one from before nodes labelled them) is that project's too."""
        owner = layer.labels.get(platform_labels.PROJECT)
        if project is None or owner == project:
            return layer
        # Only a commit's (the walk of every tag is tens of milliseconds).
        if owner is None and by_name and layer.labels.get(SOURCE, "").startswith("commit:"):
            names = self._names_of(layer.digest)
            if names and all(n.startswith(platform_labels.PROJECT_IMAGES) for n in names):
                mine = platform_labels.own_images(project)
                owner = "" if any(n.startswith(mine) for n in names) else names[0]
        if owner:
            raise ImageNotFound(
                f"layer {layer.digest} is not in this node's store", field=field, ref=layer.digest
            )
        return layer

    def tag(self, digest: str, text: str) -> None:
        ref = Ref.parse(text, "tag")
        if ref.digest:
            raise InvalidArgument("tag", "must be 'name:tag', not a digest", text)
        self.get(digest, names=False)  # must exist
        path = self.tags / str(ref.name) / str(ref.tag)
        tmp = path.with_name(f".{ref.tag}.tmp{os.getpid()}")
        for attempt in range(3):
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                tmp.write_text(digest)
                break
            except FileNotFoundError:  # an untag pruned the directory meanwhile
                if attempt == 2:
                    raise
        os.replace(tmp, path)

    def retag(self, name: str, was: str, digest: str) -> None:
        """Point tag `name` at `digest` if it still names `was`."""
        ref = Ref.parse(name, "tag")
        path = self.tags / str(ref.name) / str(ref.tag)
        try:
            if path.read_text().strip() != was:
                return
        except FileNotFoundError:
            return
        self.tag(digest, name)

    def untag(self, text: str) -> str:
        ref = Ref.parse(text, "image")
        if ref.digest:
            for name in self._names_of(ref.digest):
                self.untag(name)
            return ref.digest
        path = self.tags / str(ref.name) / str(ref.tag)
        try:
            digest = path.read_text().strip()
        except FileNotFoundError:
            raise ImageNotFound(f"image '{ref}' not found", ref=str(ref)) from None
        path.unlink()
        self._prune(path.parent)
        return digest

    def _prune(self, folder: Path) -> None:
        """Empty name folders up to the tags root: each is a step of every
        walk of the tags (a pull's host_port/repo, once untagged, stays)."""
        while folder != self.tags and folder.is_relative_to(self.tags):
            try:
                folder.rmdir()
            except OSError:  # not empty, or gone
                return
            folder = folder.parent

    def tag_map(self) -> dict[str, list[str]]:
        """Every tagged digest and its name:tags."""
        out: dict[str, list[str]] = {}
        for path in self.tags.rglob("*"):
            if path.is_file() and not path.name.startswith("."):
                rel = path.relative_to(self.tags)
                name = f"{rel.parent}:{rel.name}"
                out.setdefault(path.read_text().strip(), []).append(name)
        return out

    def _names_of(self, digest: str) -> list[str]:
        return sorted(self.tag_map().get(digest, []))

    def names(self) -> list[str]:
        """Every name:tag this store resolves."""
        return sorted(n for names in self.tag_map().values() for n in names)

    def list(self) -> list[Layer]:
        tags = self.tag_map()
        out = []
        for path in sorted(self.layers.glob("*.json")):
            digest = "sha256:" + path.stem
            try:
                doc = json.loads(path.read_text())
                out.append(Layer.from_json(doc, sorted(tags.get(digest, []))))
            except (ValueError, OSError) as exc:  # BadManifest too: one bad file hides alone
                log.warning("image.bad_manifest", path=str(path), error=str(exc)[:200])
        # Oldest first; of a layer and its identity twin (images/upgrade.py),
        # the twin, so a lookup by label finds the checkable one.
        return sorted(out, key=lambda layer: (layer.created, -layer.identity))

    def remove(self, digest: str) -> None:
        """Forget an untagged layer (its blobs go at the next gc)."""
        if self._names_of(digest):
            raise Conflict(f"layer {digest} still has tags: {', '.join(self._names_of(digest))}")
        (self.layers / f"{digest.removeprefix('sha256:')}.json").unlink(missing_ok=True)

    def chain(self, layer: Layer) -> builtins.list[Layer]:
        """The layers an image is made of, bottom first: a pulled image is a
        stack (each OCI layer one Corral layer, marked STACK, on its parent);
        any other layer is one layer alone. The layers below `layer` come
        without their names."""
        out = [layer]
        while out[0].labels.get(STACK) and out[0].parent:
            out.insert(0, self.get(out[0].parent, names=False))
            if len(out) > MAX_STACK:
                raise InvalidArgument("image", f"must be at most {MAX_STACK} layers", layer.digest)
        return out

    def inventory(self) -> tuple[dict[str, str], dict[str, tuple[str, int]]]:
        """What placement needs to know of this store: each tag's digest,
        and each layer's digest -> (the layer it stacks on, or "", its
        bytes), so a gateway can tell which nodes hold most of an image by
        content, whatever it is tagged there."""
        tags = {name: digest for digest, names in self.tag_map().items() for name in names}
        # Manifests never change once written: the listing is reread only
        # when the directory changes (a heartbeat a second must stay cheap).
        stamp = self.layers.stat().st_mtime_ns
        if self._inventory is not None and self._inventory[0] == stamp:
            return tags, dict(self._inventory[1])
        layers: dict[str, tuple[str, int]] = {}
        for path in self.layers.glob("*.json"):
            try:
                doc = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # being replaced: the next heartbeat has it
            stacked = doc.get("parent") if (doc.get("labels") or {}).get(STACK) else None
            size = int(doc.get("meta_size", 0)) + int(doc.get("blob_size", 0))
            layers["sha256:" + path.stem] = (stacked or "", size)
        self._inventory = (stamp, layers)
        return tags, dict(layers)

    def find_by_label(self, key: str, value: str) -> Layer | None:
        """The oldest layer labelled key=value that is the platform's: a
        project's own commit (named under projects/, control/project_images.py,
        or labelled with its project, even once untagged) is never taken for
        a pull's or a build's layer, whatever it says."""
        layers = self.list()
        # An old layer with an identity twin is found as its twin, or not at
        # all (the twin's names say whose it is; the old one has none).
        twinned = {(x.meta_digest, x.blob_digest) for x in layers if x.identity == IDENTITY}
        for layer in layers:
            if layer.identity == LEGACY and (layer.meta_digest, layer.blob_digest) in twinned:
                continue
            if layer.labels.get(key) != value or platform_labels.PROJECT in layer.labels:
                continue
            if not any(n.startswith(platform_labels.PROJECT_IMAGES) for n in layer.names):
                return layer
        return None

    def gc(self, in_use: set[str]) -> tuple[int, int]:
        """Drop untagged layers no sandbox uses and blobs no layer names.
        Returns (layers removed, bytes freed)."""
        tags = self.tag_map()
        removed = 0
        keep_blobs: set[str] = set()
        keep = set(tags) | in_use
        for digest in list(keep):  # a kept stack keeps the layers under it
            try:
                keep.update(layer.digest for layer in self.chain(self.get(digest)))
            except (ImageNotFound, InvalidArgument):
                pass
        # Of each manifest only what this needs (a chunk list may be ~70 MB).
        docs = {path: _gc_view(json.loads(path.read_text())) for path in self.layers.glob("*.json")}
        # A LEGACY layer stays while its identity twin (images/upgrade.py) does:
        # saved states and records may name it by its old digest.
        kept = {images for p, (images, _) in docs.items() if "sha256:" + p.stem in keep}
        for path, (images, legacy) in docs.items():
            if "sha256:" + path.stem in keep or (legacy and images in kept):
                keep_blobs.update(images)
                continue
            path.unlink()
            removed += 1
        freed = 0
        for blob in self.blobs.iterdir():
            if "sha256:" + blob.name not in keep_blobs:
                freed += blob.stat().st_size
                blob.unlink()
        for folder in sorted(self.tags.rglob("*"), key=lambda p: -len(p.parts)):
            if folder.is_dir():
                self._prune(folder)  # left by untags before they pruned
        # Temporary build trees of a crashed build; a running build's are young.
        for entry in self.tmp.iterdir():
            if entry.stat().st_mtime < time.time() - 3600:
                shutil.rmtree(entry, ignore_errors=True)
        return removed, freed
