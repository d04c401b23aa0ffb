"""mount(2) and umount2(2) without forking mount(8), and the mount table."""

from __future__ import annotations

import ctypes
import errno
import os
from pathlib import Path

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_BIND = 0x1000
MNT_DETACH = 0x2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]


class _StatFs(ctypes.Structure):
    # struct statfs on 64-bit Linux: f_type first, 120 bytes in all.
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]


def fs_magic(path: Path) -> int:
    """The file system type of path (os.statvfs does not expose it)."""
    buf = _StatFs()
    if _libc.statfs(str(path).encode(), ctypes.byref(buf)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(path))
    return int(buf.f_type) & 0xFFFFFFFF


def mount(source: str, target: str, fstype: str, flags: int = 0, data: str | None = None) -> None:
    rc = _libc.mount(
        source.encode(), target.encode(), fstype.encode(), flags, data.encode() if data else None
    )
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} {source} on {target}: {os.strerror(err)}")


def umount(target: str, detach: bool = True) -> bool:
    """Unmount; False if it was not mounted."""
    rc = _libc.umount2(target.encode(), MNT_DETACH if detach else 0)
    if rc != 0:
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ENOENT):
            return False
        raise OSError(err, f"umount {target}: {os.strerror(err)}")
    return True


def _unescape(field: str) -> str:
    # /proc/self/mountinfo escapes space, tab, newline and backslash as \ooo.
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and code.isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_table() -> list[tuple[str, str, str]]:
    """(mount point, fs type, source) for every mount this process sees."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            mount_point = _unescape(left.split()[4])
            fstype, source = right.split()[:2]
            out.append((mount_point, fstype, _unescape(source)))
    return out


def mounts_under(prefix: Path) -> list[tuple[str, str, str]]:
    p = str(prefix).rstrip("/") + "/"
    return [m for m in mount_table() if m[0].startswith(p) or m[0] == p.rstrip("/")]


def is_mounted(path: Path) -> bool:
    target = str(path)
    return any(m[0] == target for m in mount_table())
