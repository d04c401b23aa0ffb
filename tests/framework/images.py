"""The layer store the install script filled, shared by every test node (so
no test pays for debootstrap), and the image most tests run."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

IMAGES = Path(os.environ.get("CORRAL_TEST_IMAGES", "/var/lib/corral/images"))
IMAGE = "debian-python:bookworm"


def require_image(ref: str) -> None:
    """A missing image is a failure that names the install step, not a skip."""
    name, tag = ref.split(":")
    if not (IMAGES / "tags" / name / tag).exists():
        pytest.fail(f"image {ref} is missing from {IMAGES}: run ./scripts/install.sh")


def oci_layout(root: Path, layers: list[bytes], config: dict[str, object]) -> Path:
    """An OCI image layout at `root`: the given gzipped layer tars, in
    order, and the image config (its "config" object), as `docker save`
    or skopeo would leave one for import_oci."""
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> str:
        h = hashlib.sha256(data).hexdigest()
        (blobs / h).write_bytes(data)
        return "sha256:" + h

    media = "application/vnd.oci.image.layer.v1.tar+gzip"
    digests = [put(layer) for layer in layers]
    cfg = put(json.dumps({"config": config}).encode())
    manifest = put(
        json.dumps(
            {
                "schemaVersion": 2,
                "config": {"digest": cfg},
                "layers": [{"digest": d, "mediaType": media} for d in digests],
            }
        ).encode()
    )
    (root / "index.json").write_text(json.dumps({"manifests": [{"digest": manifest}]}))
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return root
