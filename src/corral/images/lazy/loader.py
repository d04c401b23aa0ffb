"""The agent's side of the lazy loader: start it, find it, watch it, stop it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Literal

from corral.errors import Unavailable
from corral.host import mounts
from corral.log import get_logger

log = get_logger("corral.lazy")
# A hung loader is refused after this; one that exits is seen at once. It
# starts in ~0.3 s on a host, but a python under TCG (tests/framework/
# v2host.py's guest) has taken 13-30 s to import and mount.
START_TIMEOUT = 90.0

Health = Literal["absent", "serving", "silent", "dead"]


class LazyLoader:
    def __init__(
        self,
        data_dir: Path,
        images: Path,
        *,
        cache_size: int,
        readahead: int = 4,
        deadline: float = 20.0,
        attempts: int = 4,
    ) -> None:
        # Below a root-only directory: the FUSE mount itself lets any user
        # in (allow_other, for the kernel's reads on a sandbox's behalf).
        self.mount = data_dir / "lazy" / "fs"
        self.cache = data_dir / "cache" / "chunks"
        self.lock = data_dir / "lazy.lock"
        self.log_file = data_dir / "lazy.log"
        self.images = images
        self.cache_size = cache_size
        self.readahead = readahead
        self.deadline = deadline
        self.attempts = attempts

    def device(self, layer_digest: str) -> Path:
        return self.mount / layer_digest.removeprefix("sha256:")

    def running_pid(self) -> int | None:
        """The loader's pid if one holds the lock, else None."""
        try:
            fd = os.open(self.lock, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode().strip()
            return int(text) if text.isdigit() else -1
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)

    def mounted(self) -> bool:
        return any(mp == str(self.mount) and "fuse" in fs for mp, fs, _ in mounts.mount_table())

    def ensure(self) -> None:
        """Start the loader unless a live one serves this node (caller holds
        the node's layer lock, so two agents never race here)."""
        if self.running_pid() is not None and self.mounted():
            return
        if self.mounted():  # a dead loader's mount: clear it first
            mounts.umount(str(self.mount))
        self.mount.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as out:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "corral.images.lazy.daemon",
                    "--mount",
                    str(self.mount),
                    "--images",
                    str(self.images),
                    "--cache",
                    str(self.cache),
                    "--cache-size",
                    str(self.cache_size),
                    "--lock",
                    str(self.lock),
                    "--readahead",
                    str(self.readahead),
                    "--deadline",
                    str(self.deadline),
                    "--attempts",
                    str(self.attempts),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,  # outlives the agent that started it
            )
        deadline = time.monotonic() + START_TIMEOUT
        while not self.mounted():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_file.read_text()[-1500:] if self.log_file.exists() else ""
                raise Unavailable(f"the lazy loader did not start: {tail}")
            time.sleep(0.02)
        log.info("lazy.started", pid=proc.pid, mount=str(self.mount))

    def stats(self, timeout: float = 2.0) -> dict[str, Any] | None:
        """The loader's statistics; None if it does not answer in time."""
        path = self.mount / ".stats"
        box: list[dict[str, Any]] = []

        def read() -> None:
            try:
                box.append(json.loads(path.read_bytes()))
            except (OSError, ValueError):
                pass

        # A daemon thread: a loader that hangs must not hang the agent's exit.
        t = threading.Thread(target=read, daemon=True, name="lazy-stats")
        t.start()
        t.join(timeout)
        return box[0] if box else None

    def health(self) -> Health:
        """ "absent": no loader mount (nothing to serve). "dead": its mount is
        there and no process holds its lock; the kernel drops a lock with
        its holder, so this is certain. "silent": a holder that did not
        answer in time; slow (a busy host, an emulated CPU, a read
        retrying the store) until it has been silent for long, so this
        alone condemns nothing. "serving": it answered."""
        if not self.mounted():
            return "absent"
        if self.running_pid() is None:
            return "dead"
        return "serving" if self.stats() is not None else "silent"

    def kill(self) -> int | None:
        """Kill the loader holding the lock (a hung one: it is not asked)
        and wait, briefly, for the lock to be free. Its pid, or None."""
        pid = self.running_pid()
        if pid is None or pid <= 0:
            return None
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while self.running_pid() is not None and time.monotonic() < deadline:
            time.sleep(0.02)
        return pid

    def stop(self) -> None:
        if self.mounted():
            mounts.umount(str(self.mount))
            log.info("lazy.stopped", mount=str(self.mount))
