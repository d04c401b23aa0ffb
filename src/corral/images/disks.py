"""Users' own VM disks: a qcow2 or raw file (a Windows install, another
OS, an installer) that a full VM boots with no Corral agent inside.

A disk is added once per node, by name, into the node's disk directory
(`corral disk add PATH`), and a sandbox names it as its image:
`image="disk:NAME"`. The file there is read-only and never changes: each
sandbox writes to a qcow2 overlay of its own backed by it (runtimes/vm),
so any number of sandboxes share one copy of the disk.

A disk is a hostile input, checked on add and again at each create:
qemu-img must call it qcow2 or raw, a qcow2 may not point at any other
file (a backing file or an external data file would let the image read
the host's files through the guest), and a raw file must start with a
boot sector (anything at all is "raw" to QEMU: a text file would boot to
a firmware's "no bootable device").
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from corral.errors import Conflict, InvalidArgument, Unavailable

PREFIX = "disk:"
FIRMWARES = ("bios", "uefi")
_BASE = r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}"
BASE = re.compile(_BASE)
# On a cluster a project's own disks are named under projects/<project>/
# (as its images are: control/project_images.py) and only it may boot them;
# every other disk is the operator's, for every project.
NAME = re.compile(rf"(?:projects/[a-z0-9][a-z0-9_-]{{0,62}}/)?{_BASE}")
NAME_RULE = (
    "a disk's name is 1-64 letters, digits and . _ - (not starting with . _ -), "
    "under projects/<project>/ for one project's own"
)
FORMATS = ("qcow2", "raw")
BOOT_SIGNATURE = b"\x55\xaa"  # at byte 510: MBR, a GPT's protective MBR, a hybrid ISO
COPY_STEP = 64 << 20


def is_disk(ref: str) -> bool:
    """Whether an image reference names a user's disk ('disk:NAME')."""
    return ref.startswith(PREFIX)


def disk_name(ref: str, field: str = "image") -> str:
    """The NAME of 'disk:NAME', checked."""
    name = ref.removeprefix(PREFIX)
    if not NAME.fullmatch(name) or name == "projects":  # the projects' own disks' folder
        raise InvalidArgument(field, NAME_RULE, ref)
    return name


@dataclass(frozen=True)
class DiskImage:
    name: str
    path: Path
    format: str  # "qcow2" or "raw"
    virtual_size: int  # bytes the guest sees
    file_size: int  # bytes on the host

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "ref": PREFIX + self.name,
            "format": self.format,
            "virtual_size": self.virtual_size,
            "file_size": self.file_size,
        }


def inspect(path: Path, field: str = "path") -> tuple[str, int]:
    """(format, virtual size) of a disk image, or InvalidArgument naming
    `field` and what is wrong with it."""
    if not path.is_file():
        raise InvalidArgument(
            field, "must be a regular file (a qcow2 or raw disk image)", str(path)
        )
    try:
        # -U: a disk a running VM holds open may still be inspected.
        proc = subprocess.run(
            ["qemu-img", "info", "-U", "--output=json", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except FileNotFoundError:
        raise Unavailable("qemu-img is not installed (apt install qemu-utils)") from None
    if proc.returncode != 0:
        why = proc.stderr.strip().splitlines()[-1:] or ["unreadable"]
        raise InvalidArgument(field, f"must be a qcow2 or raw disk image: {why[0]}", str(path))
    info = json.loads(proc.stdout)
    fmt = info.get("format")
    if fmt not in FORMATS:
        raise InvalidArgument(
            field,
            f"must be a qcow2 or raw disk image, not {fmt!r} (qemu-img convert it)",
            str(path),
        )
    if info.get("backing-filename") or info.get("full-backing-filename"):
        raise InvalidArgument(
            field,
            "must not have a backing file (it would be read from the host): "
            "qemu-img convert it into one file",
            str(path),
        )
    data = info.get("format-specific", {}).get("data", {})
    if data.get("data-file"):
        raise InvalidArgument(field, "must not have an external data file", str(path))
    if fmt == "raw":
        with open(path, "rb") as f:
            head = f.read(512)
        if len(head) < 512 or head[510:512] != BOOT_SIGNATURE:
            raise InvalidArgument(
                field,
                "must be a disk image: a raw disk starts with a boot sector (0x55AA at byte 510)",
                str(path),
            )
    return str(fmt), int(info["virtual-size"])


class Disks:
    """The node's disks: one file per name in `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, name: str) -> Path:
        return self.root / name

    def get(self, ref: str, field: str = "image") -> DiskImage:
        """The disk `ref` ('disk:NAME' or NAME) names, checked as on add
        (the file may have been replaced behind the node's back)."""
        name = disk_name(ref, field)
        path = self.path(name)
        if not path.is_file():
            raise InvalidArgument(
                field, "names no disk on this node (add it with `corral disk add PATH`)", ref
            )
        fmt, size = inspect(path, field)
        return DiskImage(name, path, fmt, size, path.stat().st_size)

    def list(self) -> list[DiskImage]:
        if not self.root.is_dir():
            return []
        owned = self.root / "projects"
        found = [p.name for p in self.root.iterdir()]
        if owned.is_dir():
            found += [f"projects/{d.name}/{p.name}" for d in owned.iterdir() if d.is_dir()
                      for p in d.iterdir()]  # fmt: skip
        out = []
        for name in sorted(found):
            if NAME.fullmatch(name) and self.path(name).is_file():
                try:
                    out.append(self.get(name))
                except InvalidArgument:
                    continue  # a file that is no longer a disk is not offered
        return out

    def add(
        self,
        source: Path,
        name: str | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> DiskImage:
        """Copy the disk at `source` in as `name` (its file name by default).
        The copy is checked again (the source may change while it is read)
        and made read-only before it appears under its name."""
        name = disk_name(name or source.name, "name")
        inspect(source)
        dest = self.path(name)
        if dest.exists():
            raise Conflict(f"a disk named {name!r} exists: remove it first (`corral disk rm`)")
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.{os.getpid()}.tmp"
        try:
            _copy(source, tmp, progress)
            os.chmod(tmp, 0o444)
            inspect(tmp)
            # link, not rename: a concurrent add of the same name fails here.
            os.link(tmp, dest)
        except FileExistsError:
            raise Conflict(f"a disk named {name!r} exists: remove it first") from None
        finally:
            tmp.unlink(missing_ok=True)
        return self.get(name)

    def remove(self, ref: str) -> None:
        """Forget a disk. Its sandboxes keep it open while they run; a
        suspended one cannot resume without it."""
        name = disk_name(ref, "name")
        try:
            self.path(name).unlink()
        except FileNotFoundError:
            raise InvalidArgument("name", "names no disk on this node", ref) from None


def _copy(source: Path, dest: Path, progress: Callable[[int, int], None] | None) -> None:
    """Copy a (possibly sparse, possibly huge) file: its data extents only,
    through copy_file_range (which reflinks where the file system can)."""
    size = source.stat().st_size
    with open(source, "rb") as src, open(dest, "wb") as out:
        os.ftruncate(out.fileno(), size)
        pos = 0
        while pos < size:
            try:
                start = os.lseek(src.fileno(), pos, os.SEEK_DATA)
            except OSError:
                break  # no data after pos: the rest is a hole
            end = os.lseek(src.fileno(), start, os.SEEK_HOLE)
            at = start
            while at < end:
                n = os.copy_file_range(src.fileno(), out.fileno(), min(COPY_STEP, end - at), at, at)
                if n == 0:
                    raise OSError(f"{source} shrank while it was copied")
                at += n
                if progress is not None:
                    progress(at, size)
            pos = end
    if progress is not None:
        progress(size, size)
