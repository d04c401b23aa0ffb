"""A program's binary copied once into a sealed memfd, run from there.

crun and runc protect the host binary against a container overwriting it
through /proc/self/exe (CVE-2019-5736) by running from a copy: unless the
binary they start from is already a fully sealed memfd (or on a read-only
mount), each call copies itself into one (or bind-mounts itself read-only
in a temporary file), then re-executes. That is a second exec, a dynamic
link and mount table work on every create and every delete: about 2 ms of
CPU a call here (docs/container-runtime.md). A sealed memfd made once per
agent and handed to corral-nsexec (`--exec-fd`) is the same protection,
paid once: nothing can write to a sealed memfd, whoever holds it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from corral.log import get_logger

log = get_logger("corral.sealed")

# What crun's and runc's "am I a clone already?" checks require: all four.
SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE
_MFD_EXEC = 0x0010  # linux/memfd.h; needed where vm.memfd_noexec is 1
_NOEXEC_SYSCTL = Path("/proc/sys/vm/memfd_noexec")


def sealed_copy(binary: str) -> int | None:
    """A close-on-exec fd of a sealed memfd holding `binary`'s bytes, or
    None where this kernel will not execute a memfd (vm.memfd_noexec = 2)
    or the copy fails: callers then run the binary from its path, which
    works the same, only slower."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    try:
        noexec = int(_NOEXEC_SYSCTL.read_text())
    except (OSError, ValueError):
        noexec = 0  # before Linux 6.3: every memfd is executable
    if noexec >= 2:
        log.info("sealed.unavailable", binary=binary, why="vm.memfd_noexec=2")
        return None
    if noexec == 1:
        flags |= _MFD_EXEC
    try:
        data = Path(binary).read_bytes()
        fd = os.memfd_create(Path(binary).name, flags)
    except OSError as exc:
        log.warning("sealed.unavailable", binary=binary, why=str(exc))
        return None
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError as exc:
        os.close(fd)
        log.warning("sealed.unavailable", binary=binary, why=str(exc))
        return None
    return fd
