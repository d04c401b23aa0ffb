"""A layer: one EROFS image split into a small metadata image and a data blob.

The metadata image holds the directory tree and inodes; the blob holds file
data in fixed-size chunks (mkfs.erofs --chunksize --blobdev). A node needs
the metadata whole to mount, but only the blob chunks a sandbox reads: that
split is what makes on-demand loading possible.

A layer's digest is the sha256 of its manifest's content: the two images,
each chunk's digest, its config, kind, labels and parent (everything but
when it was made and what it is tagged), so retagging changes nothing,
equal content is stored once, and a store that serves a layer by its digest
can change nothing a node reads from it (docs/layer-identity.md).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from corral.errors import InvalidArgument

_NAME = re.compile(r"^[a-z0-9][a-z0-9._/-]{0,127}$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
LAYER_KINDS = ("base", "workspace", "toolkit", "layer")
# The label of a layer that sits on its parent as part of one image (a
# pulled image's layers), and the most layers such an image may have (an
# overlay mount takes about 500 lower directories; a sandbox adds its own).
STACK = "corral.stack"
MAX_STACK = 128
# How a layer's digest is computed. LEGACY (manifests written before
# identity 2, which have no `identity` field) covers only the two images'
# whole digests, the chunk size, the config and a stack's parent: a store
# could swap its chunk digests, labels or kind under the same digest, so a
# LEGACY layer from another store is checked in full before use
# (registry.pull).
LEGACY, IDENTITY = 1, 2


@dataclass(frozen=True)
class Ref:
    """'name:tag' (tag defaults to 'latest') or a content digest."""

    name: str | None
    tag: str | None
    digest: str | None

    @classmethod
    def parse(cls, text: str, field: str = "image") -> Ref:
        if _DIGEST.match(text):
            return cls(None, None, text)
        remote = RegistryRef.parse(text, field)
        if remote is not None:  # held under its local name once pulled
            return cls(remote.local_name, remote.local_tag, None)
        name, sep, tag = text.partition(":")
        tag = tag if sep else "latest"
        if not _NAME.match(name) or not _TAG.match(tag) or ".." in name or name == "sha256":
            raise InvalidArgument(
                field, "must be a layer reference like 'name:tag' or 'sha256:<64 hex>'", text
            )
        return cls(name, tag, None)

    def __str__(self) -> str:
        return self.digest or f"{self.name}:{self.tag}"


_HOST = re.compile(
    r"^(localhost|[A-Za-z0-9-]+(\.[A-Za-z0-9-]+)+|[A-Za-z0-9.-]+:[0-9]{1,5}|\[[0-9a-fA-F:]+\](:[0-9]{1,5})?)$"
)
_REPO = re.compile(r"^[a-z0-9]+([._-]+[a-z0-9]+)*(/[a-z0-9]+([._-]+[a-z0-9]+)*)*$")


@dataclass(frozen=True)
class RegistryRef:
    """An image in an OCI registry: HOST[:PORT]/REPO[:TAG|@DIGEST]. A
    reference names a registry when its first part is a host (it has a
    dot or a port, or is localhost), as Docker reads it; `debian:bookworm`
    stays a local name. Pulled, it is held under `local_name:local_tag`
    (a colon is not allowed in a local name: HOST:PORT becomes HOST_PORT)."""

    host: str
    repo: str
    tag: str | None
    digest: str | None

    @classmethod
    def parse(cls, text: str, field: str = "image") -> RegistryRef | None:
        first, slash, rest = text.partition("/")
        if not slash or not _HOST.match(first):
            return None
        digest = None
        if "@" in rest:
            rest, _, digest = rest.partition("@")
            if not _DIGEST.match(digest):
                raise InvalidArgument(field, "must end in @sha256:<64 hex> after an @", text)
        repo, sep, tag = rest.rpartition(":") if ":" in rest else (rest, "", "")
        if not sep:
            repo, tag = rest, ("" if digest else "latest")
        if not _REPO.match(repo) or (tag and not _TAG.match(tag)) or len(repo) > 200:
            raise InvalidArgument(
                field, "must be a registry reference like 'host[:port]/repo[:tag|@sha256:...]'",
                text,
            )  # fmt: skip
        return cls(first, repo, tag or None, digest)

    @classmethod
    def for_pull(cls, text: str) -> RegistryRef:
        """What `pull` reads: a registry reference, or Docker Hub's
        shorthand (`debian:bookworm` is docker.io/library/debian:bookworm)."""
        found = cls.parse(text, "ref")
        if found is not None:
            return found
        if "/" not in text.split(":")[0].split("@")[0]:
            text = "library/" + text
        found = cls.parse("docker.io/" + text, "ref")
        assert found is not None
        return found

    @property
    def local_name(self) -> str:
        return f"{self.host.replace(':', '_').strip('[]')}/{self.repo}".lower()

    @property
    def local_tag(self) -> str:
        if self.digest is not None:
            return "sha256-" + self.digest[7:]
        return self.tag or "latest"

    def __str__(self) -> str:
        return f"{self.host}/{self.repo}" + (f"@{self.digest}" if self.digest else f":{self.tag}")


DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_HEX = re.compile(r"[0-9a-f]{64}")
CHUNK_SIZES = frozenset(1 << n for n in range(12, 27))  # 4 KiB .. 64 MiB
MAX_BLOB = 16 << 40


def _sha256_json(doc: dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


class BadManifest(ValueError):
    """A layer manifest that breaks its own rules (from a damaged or hostile
    store): the caller says which store, and uses nothing of it."""


@dataclass(frozen=True)
class ImageConfig:
    """Defaults a layer gives a sandbox started on it (from OCI configs)."""

    env: list[str] = field(default_factory=list)
    workdir: str | None = None
    user: str | None = None


@dataclass(frozen=True)
class Layer:
    digest: str
    kind: str
    meta_digest: str
    meta_size: int
    blob_digest: str
    blob_size: int
    chunk_size: int
    chunk_digests: list[str]
    content_size: int
    config: ImageConfig
    created: float
    parent: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    identity: int = LEGACY
    # The tags this layer carries in its store; not part of its content.
    names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # A manifest may come from a store the node does not control: its
        # digests become host paths (blob_path) and its chunk geometry sizes
        # the lazy loader's maps, so both are held to their forms here.
        for name in ("digest", "meta_digest", "blob_digest", "parent"):
            value = getattr(self, name)
            if (value is not None or name != "parent") and not (
                isinstance(value, str) and DIGEST.fullmatch(value)
            ):
                raise BadManifest(f"{name} must be sha256:<64 hex>, not {str(value)[:80]!r}")
        if self.chunk_size not in CHUNK_SIZES:
            raise BadManifest(
                f"chunk_size must be a power of two from 4 KiB to 64 MiB: {self.chunk_size!r}"
            )
        for name in ("blob_size", "meta_size", "content_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BLOB:
                raise BadManifest(f"{name} must be whole bytes up to 16 TiB: {value!r}")
        chunks = -(-self.blob_size // self.chunk_size)
        if not isinstance(self.chunk_digests, list) or len(self.chunk_digests) != chunks:
            raise BadManifest(f"chunk_digests must list the blob's {chunks} chunks")
        if not all(isinstance(c, str) and _HEX.fullmatch(c) for c in self.chunk_digests):
            raise BadManifest("chunk_digests must be 64 hex digits each")
        if (
            isinstance(self.created, bool)
            or not isinstance(self.created, int | float)
            or not math.isfinite(self.created)
        ):
            raise BadManifest(f"created must be a time in seconds: {str(self.created)[:40]!r}")
        if self.identity not in (LEGACY, IDENTITY) or isinstance(self.identity, bool):
            raise BadManifest(f"identity must be {LEGACY} or {IDENTITY}: {self.identity!r}")
        if not isinstance(self.labels, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in self.labels.items()
        ):
            raise BadManifest("labels must map text to text")

    @staticmethod
    def legacy_digest(
        meta_digest: str,
        blob_digest: str,
        chunk_size: int,
        config: ImageConfig,
        stacked_on: str | None = None,
    ) -> str:
        """A LEGACY layer's identity. A layer of a stack (STACK) is also what
        it sits on: the same OCI layer over two different bases is two layers."""
        fields: dict[str, Any] = {
            "meta": meta_digest,
            "blob": blob_digest,
            "chunk_size": chunk_size,
            "config": asdict(config),
        }
        if stacked_on is not None:
            fields["stacked_on"] = stacked_on
        return _sha256_json(fields)

    def expected_digest(self) -> str:
        """The digest this manifest's content makes, under its identity."""
        if self.identity == LEGACY:
            stacked_on = self.parent if self.labels.get(STACK) else None
            return Layer.legacy_digest(
                self.meta_digest, self.blob_digest, self.chunk_size, self.config, stacked_on
            )
        doc = self.to_json()
        for outside in ("digest", "created"):  # itself, and a time: equal content, one layer
            doc.pop(outside)
        # The chunk list is long (a digest per 64 KiB): its own digest stands for it.
        doc["chunk_digests"] = hashlib.sha256("".join(self.chunk_digests).encode()).hexdigest()
        return _sha256_json(doc)

    def identified(self) -> Layer:
        """This layer under its own (IDENTITY) digest."""
        current = replace(self, identity=IDENTITY)
        return replace(current, digest=current.expected_digest())

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("names")
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any], names: list[str] | None = None) -> Layer:
        """A manifest as stored; BadManifest if it is not one."""
        try:
            d = dict(d)
            d["config"] = ImageConfig(**d["config"])
            return cls(**d, names=names or [])
        except (TypeError, KeyError, ValueError) as exc:
            if isinstance(exc, BadManifest):
                raise
            raise BadManifest(f"not a layer manifest: {exc}") from None
