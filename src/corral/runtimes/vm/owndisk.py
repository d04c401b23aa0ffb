"""A full VM booted from a user's own disk (images/disks.py): its writable
state, made before QEMU starts and carried through forks.

The user's disk is never written: the sandbox writes to a qcow2 overlay
backed by it, in the sandbox's scratch subvolume (so its `disk` bytes
bound what the guest may write). UEFI sandboxes also keep a copy of
OVMF's variables store. A fork's copies each start from a copy of both,
taken while the source is paused with the memory it pairs with.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from corral.errors import SandboxFailed, Unavailable
from corral.images.disks import DiskImage
from corral.runtimes.vm.qemu import OVMF_CODE, OVMF_VARS

RECORD = "own-disk.json"  # in the sandbox's dir: what its QEMU was given
OVERLAY = "disk.qcow2"
VARS = "efivars.fd"
# With no agent inside, nothing says which screen is the OS's first: the
# sandbox is ready when its screen has something drawn and has held still
# this long (an OS that boots animates; OVMF's splash holds ~3.4 s here).
QUIET = 5.0
# An OS installed for real hardware may take many minutes to boot under TCG.
DRAWN_TIMEOUT = 900.0


@dataclass(frozen=True)
class OwnDisk:
    overlay: Path
    vars: Path | None  # None: BIOS

    def save(self, sandbox_dir: Path) -> None:
        doc = {"overlay": str(self.overlay), "vars": str(self.vars) if self.vars else None}
        (sandbox_dir / RECORD).write_text(json.dumps(doc))

    @staticmethod
    def of(sandbox_dir: Path) -> OwnDisk | None:
        """The sandbox's own disk, if it boots one."""
        try:
            doc = json.loads((sandbox_dir / RECORD).read_text())
        except FileNotFoundError:
            return None
        return OwnDisk(Path(doc["overlay"]), Path(doc["vars"]) if doc["vars"] else None)


def companions(state: Path) -> tuple[Path, Path]:
    """The overlay and variables saved beside a machine state (a fork's):
    they share its name, so whoever drops the state drops them with it."""
    return state.with_name(state.name + ".disk"), state.with_name(state.name + ".vars")


def prepare(disk: DiskImage, own: OwnDisk, state: Path | None) -> None:
    """Make the sandbox's overlay and variables: fresh over `disk`, or the
    copies saved with `state` (a fork)."""
    if own.vars is not None and not (OVMF_CODE.is_file() and OVMF_VARS.is_file()):
        raise Unavailable(f"firmware 'uefi' needs OVMF ({OVMF_CODE}: apt install ovmf)")
    if state is not None:
        disk_copy, vars_copy = companions(state)
        _copy(disk_copy, own.overlay)
        if own.vars is not None:
            _copy(vars_copy, own.vars)
        return
    argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(disk.path), "-F", disk.format]
    proc = subprocess.run(
        [*argv, str(own.overlay)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SandboxFailed(f"making the overlay of disk {disk.name} failed: {proc.stderr[-500:]}")
    if own.vars is not None:
        shutil.copyfile(OVMF_VARS, own.vars)


def keep_for_copies(own: OwnDisk, state: Path) -> None:
    """Copy the overlay and variables beside `state`. The guest must be
    paused and its drives flushed (a completed migration has both)."""
    disk_copy, vars_copy = companions(state)
    _copy(own.overlay, disk_copy)
    if own.vars is not None:
        _copy(own.vars, vars_copy)


def _copy(src: Path, dest: Path) -> None:
    # A reflink where the file system has them (the scratch subvolumes'
    # btrfs): a fork of a sandbox that wrote gigabytes copies nothing.
    proc = subprocess.run(
        ["cp", "--reflink=auto", "--sparse=always", str(src), str(dest)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise SandboxFailed(f"copying {src.name} failed: {proc.stderr.strip()[-300:]}")
