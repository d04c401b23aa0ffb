"""PyPI wheels installed on the host into a layer's tree, for the images'
Python (Debian bookworm's CPython 3.11, glibc, x86_64), whatever Python
runs the build: the toolkits of the code interpreter and of function
calls are made this way (the build sandbox has no network)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from corral.errors import Unavailable
from corral.images.store import ProgressFn

SITE = "usr/local/lib/python3.11/dist-packages"
WHEELS = [
    "--only-binary=:all:",
    "--implementation", "cp",
    "--python-version", "3.11",
    "--abi", "cp311",
    # pip does not widen one manylinux tag to the older ones: each is named.
    *(f"--platform=manylinux_2_{v}_x86_64" for v in (36, 35, 34, 31, 28, 27, 24, 17)),
    "--platform=manylinux2014_x86_64",
    "--platform=manylinux1_x86_64",
]  # fmt: skip


def install(stage: Path, packages: list[str], what: str, progress: ProgressFn) -> None:
    """pip install `packages` (pinned by the caller) into stage's site-packages."""
    progress(f"pip install {what}", 0, 1)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-compile",
         "--target", str(stage / SITE), *WHEELS, *packages],
        capture_output=True, text=True,
    )  # fmt: skip
    if proc.returncode != 0:
        raise Unavailable(f"pip install of {what} failed: {(proc.stderr or proc.stdout)[-1500:]}")
    progress(f"pip install {what}", 1, 1)


def launcher(stage: Path, name: str, entry: str) -> None:
    """/usr/local/bin/<name> running `module:function` with the image's
    Python (pip --target writes none that would run in the image)."""
    module, func = entry.split(":")
    script = stage / "usr/local/bin" / name
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(
        f"#!/usr/bin/python3\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n"
    )
    script.chmod(0o755)
