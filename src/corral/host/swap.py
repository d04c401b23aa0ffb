"""The node's own swap file, where frozen and idle sandboxes' memory goes,
and the host's memory savers it turns on (zswap, KSM).

Enabled when a node agent starts and left on while the node has any
sandbox: a frozen one may hold pages in it at any moment, and agents come
and go (an embedded client per trainer). The last agent of a node with no
sandbox turns it off and removes it. A running sandbox's own memory
pressure never swaps (memory+swap equal to memory; v2: swap.max 0, v1:
swappiness 0): only the node's reclaim (host/cgroups.py), of a frozen
sandbox or one idle for reclaim_after, pushes pages out, through zswap
where the host has it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

from corral.log import get_logger

log = get_logger("corral.node")


def active(path: Path) -> bool:
    try:
        lines = Path("/proc/swaps").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(line.split()[0] == str(path) for line in lines if line.split())


def host_swap_bytes() -> int:
    """Swap the host has in all (ours included)."""
    total = 0
    try:
        for line in Path("/proc/swaps").read_text().splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 3:
                total += int(parts[2]) * 1024
    except (OSError, ValueError):
        pass
    return total


ZSWAP = Path("/sys/module/zswap/parameters")


def enable_zswap(params: Path = ZSWAP) -> bool:
    """Compress pages on their way to swap (lz4 where the kernel has it,
    else its default). False where the kernel has no zswap. Left on (a
    host setting that other nodes of the host may rely on; see
    docs/memory-reclaim.md)."""
    try:
        if (params / "enabled").read_text().strip() != "Y":
            with contextlib.suppress(OSError):  # lz4 not built: keep the default
                (params / "compressor").write_text("lz4")
            (params / "enabled").write_text("Y")
    except OSError as exc:
        log.info("zswap.unavailable", error=str(exc))
        return False
    return True


def ensure(path: Path, size: int) -> bool:
    """Make `path` a swap file of `size` bytes and enable it (idempotent).
    False, logged, where the host refuses (no CAP_SYS_ADMIN, a file
    system swap cannot live on): frozen sandboxes then only drop their
    page cache."""
    if active(path):
        return True
    try:
        if not path.exists() or path.stat().st_size != size:
            path.unlink(missing_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)  # swap needs its blocks allocated
            finally:
                os.close(fd)
            subprocess.run(["mkswap", str(path)], check=True, capture_output=True)
        subprocess.run(["swapon", str(path)], check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        why = getattr(exc, "stderr", None) or str(exc)
        log.warning("swap.unavailable", path=str(path), error=str(why).strip())
        # A fallocate that ran out of space keeps what it got: a file that
        # is no swap would hold the disk it filled (seen: 26 GiB of a full
        # disk, every later write on the host refused).
        path.unlink(missing_ok=True)
        return False
    log.info("swap.enabled", path=str(path), bytes=size)
    return True


def disable(path: Path) -> None:
    """Turn the node's swap file off and remove it (nothing if absent).
    Pages still in it come back to RAM first (swapoff does that)."""
    if active(path):
        proc = subprocess.run(["swapoff", str(path)], capture_output=True, text=True)
        if proc.returncode != 0:
            log.warning("swap.swapoff_failed", path=str(path), error=proc.stderr.strip())
            return
    path.unlink(missing_ok=True)


KSM = Path("/sys/kernel/mm/ksm")


def enable_ksm(ksm: Path = KSM) -> bool:
    """Start the kernel's same-page merging (left on: a host setting that
    other nodes of the host may rely on). False where the kernel lacks it."""
    try:
        if (ksm / "run").read_text().strip() != "1":
            (ksm / "run").write_text("1")
    except OSError as exc:
        log.info("ksm.unavailable", error=str(exc))
        return False
    return True
