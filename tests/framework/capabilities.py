"""What a test needs of this machine, each probe naming the missing piece
and how to install it. The skip markers (requires_qemu, ...) are applied in
tests/conftest.py; a test skips only when the capability is truly absent."""

from __future__ import annotations

import functools
import glob
import importlib.util
import os
import shutil
from collections.abc import Callable
from pathlib import Path


@functools.cache
def missing_platform() -> str | None:
    """What every sandbox test needs: root, the file systems, crun."""
    if os.geteuid() != 0:
        return "requires root (mount(2), cgroups and namespaces need CAP_SYS_ADMIN)"
    fs = Path("/proc/filesystems").read_text()
    for name in ("overlay", "erofs", "btrfs", "fuse"):
        if name not in fs:
            return f"requires the {name} file system in the kernel (/proc/filesystems)"
    if not shutil.which("crun"):
        return "requires crun on PATH (apt-get install crun)"
    return None


@functools.cache
def missing_qemu() -> str | None:
    if shutil.which("qemu-system-x86_64") is None:
        return "requires qemu-system-x86_64 (apt install qemu-system-x86)"
    return None


@functools.cache
def missing_postgres(packages: str = "/usr/lib/postgresql") -> str | None:
    # Where corral/control/postgres.py looks for initdb: the Debian
    # packages' versioned directories, then PATH.
    if not glob.glob(f"{packages}/*/bin/initdb") and shutil.which("initdb") is None:
        return "requires PostgreSQL's server binaries (apt install postgresql)"
    return None


@functools.cache
def missing_ray() -> str | None:
    if importlib.util.find_spec("ray") is None:
        return "requires Ray (pip install 'corral[cluster]')"
    return None


# Marker name -> probe; the markers are registered in pyproject.toml.
REQUIREMENTS: dict[str, Callable[[], str | None]] = {
    "requires_qemu": missing_qemu,
    "requires_postgres": missing_postgres,
    "requires_ray": missing_ray,
}
