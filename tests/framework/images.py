"""The layer store the install script filled, shared by every test node (so
no test pays for debootstrap), and the image most tests run."""

from __future__ import annotations

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
