"""A sandbox's directory on the data disk, recycled rather than remade.

Every sandbox has a directory under <data_dir>/sandboxes (its command log
from the first state change on; checkpoints, a VM's files), made at create
and gone at close. Making it costs the file system two new inodes (the
directory and commands.log), and on ext4 without a journal a new inode is
dear once many were freed recently: ext4 then avoids an inode freed in the
last minute (five if its table block is still dirty), and finds one by
walking the group's free inodes past every such one, a buffer lookup each
(ialloc.c `recently_deleted`). At 100+ creates and closes a second that is
thousands of inodes: 0.3-0.5 ms of CPU per mkdir, on the agent's loop.

So a closed sandbox's directory is emptied (all but commands.log, which
is truncated) and parked in <data_dir>/sandboxes.spare, and a create takes
a parked one by rename: no inode is made or freed while the pool lasts.

Invariants: a parked directory holds nothing but an empty commands.log
(what take finds otherwise it removes, and it truncates the log again
after the rename, on the loop thread that alone appends to logs, so no
line of an earlier sandbox survives into a later one's log). Parking is
by rename inside one file system, so a directory is in exactly one place;
two agents sharing a data dir race only for the same spare, and the
loser's rename fails and it tries the next. At most `keep` are parked.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from corral.log import get_logger

log = get_logger("corral.sandboxdirs")

LOG = "commands.log"


class SandboxDirs:
    def __init__(self, root: Path, spare: Path, keep: int = 1024) -> None:
        self.root = root
        self.spare = spare
        spare.mkdir(mode=0o700, exist_ok=True)
        # Parking is a rename: none where the two are apart (a mount between).
        self.keep = keep if root.stat().st_dev == spare.stat().st_dev else 0

    def make(self, sandbox_id: str, mode: int) -> Path:
        """The sandbox's directory, new and empty but for an empty command
        log where a spare was taken. FileExistsError if it is there already
        (as mkdir)."""
        path = self.root / sandbox_id
        if path.exists():
            raise FileExistsError(f"sandbox directory {path} exists")
        for name in self._spares():
            try:
                os.rename(self.spare / name, path)
            except FileNotFoundError:
                continue  # another agent took it
            except OSError as exc:
                log.warning("sandboxdirs.take_failed", spare=name, error=str(exc))
                break
            if self._clean(path):
                os.chmod(path, mode)
                return path
            shutil.rmtree(path, ignore_errors=True)
        path.mkdir(mode=mode)
        return path

    def remove(self, ref: str) -> None:
        """Park a closed sandbox's directory, or remove it where the pool is
        full or what is in it cannot be emptied (blocking: run off the loop).
        Any other directory (the ledger's "dir" is also a runtime's bundle
        on the run tmpfs) is removed."""
        path = Path(ref)
        try:
            if path.parent == self.root and len(self._spares()) < self.keep and self._empty(path):
                os.chmod(path, 0o700)
                os.rename(path, self.spare / path.name)
                return
        except OSError as exc:
            log.warning("sandboxdirs.park_failed", path=ref, error=str(exc))
        shutil.rmtree(path, ignore_errors=True)

    def _spares(self) -> list[str]:
        try:
            return os.listdir(self.spare)
        except FileNotFoundError:
            return []

    @staticmethod
    def _empty(path: Path) -> bool:
        """Everything but a regular commands.log removed, and that truncated.
        False if `path` is not a real directory or something stays."""
        if path.is_symlink() or not path.is_dir():
            return False
        for entry in os.scandir(path):
            if entry.name == LOG and entry.is_file(follow_symlinks=False):
                os.truncate(entry.path, 0)
            elif entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)
        return os.listdir(path) in ([], [LOG])

    @staticmethod
    def _clean(path: Path) -> bool:
        """A taken spare as parked: at most an empty, regular commands.log."""
        names = os.listdir(path)
        if names == []:
            return True
        if names != [LOG] or not (path / LOG).is_file() or (path / LOG).is_symlink():
            return False
        os.truncate(path / LOG, 0)
        return True
