"""A layer: one EROFS image split into a small metadata image and a data blob.

The metadata image holds the directory tree and inodes; the blob holds file
data in fixed-size chunks (mkfs.erofs --chunksize --blobdev). A node needs
the metadata whole to mount, but only the blob chunks a sandbox reads: that
split is what makes on-demand loading possible.

A layer's digest is the sha256 of its content (the two images and its
config), so retagging changes nothing and equal content is stored once.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from corral.errors import InvalidArgument

_NAME = re.compile(r"^[a-z0-9][a-z0-9._/-]{0,127}$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
LAYER_KINDS = ("base", "workspace", "toolkit", "layer")


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
        name, sep, tag = text.partition(":")
        tag = tag if sep else "latest"
        if not _NAME.match(name) or not _TAG.match(tag) or ".." in name or name == "sha256":
            raise InvalidArgument(
                field, "must be a layer reference like 'name:tag' or 'sha256:<64 hex>'", text
            )
        return cls(name, tag, None)

    def __str__(self) -> str:
        return self.digest or f"{self.name}:{self.tag}"


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
    # The tags this layer carries in its store; not part of its content.
    names: list[str] = field(default_factory=list)

    @staticmethod
    def content_digest(
        meta_digest: str, blob_digest: str, chunk_size: int, config: ImageConfig
    ) -> str:
        doc = json.dumps(
            {
                "meta": meta_digest,
                "blob": blob_digest,
                "chunk_size": chunk_size,
                "config": asdict(config),
            },
            sort_keys=True,
        )
        return "sha256:" + hashlib.sha256(doc.encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("names")
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any], names: list[str] | None = None) -> Layer:
        d = dict(d)
        d["config"] = ImageConfig(**d["config"])
        return cls(**d, names=names or [])
