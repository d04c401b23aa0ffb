"""Frames between the node agent and corral-init; mirrors native/proto.h.

A frame is ``u32 length | u32 stream | u8 type | payload`` (little-endian).
Strings are ``u32 length | bytes``; string lists are ``u32 count | strings``.
Pure encoding and decoding: no I/O here.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

VERSION = 1
HEADER = struct.Struct("<IIB")
MAX_PAYLOAD = 1 << 20

REQ_PING = 0x01
REQ_EXEC = 0x10
REQ_STDIN = 0x11
REQ_STDIN_EOF = 0x12
REQ_SIGNAL = 0x13
REQ_RESIZE = 0x14
REQ_READ = 0x20
REQ_WRITE = 0x21
REQ_LIST = 0x22
REQ_STAT = 0x23
REQ_MKDIR = 0x24
REQ_REMOVE = 0x25
REQ_KILL = 0x26
REQ_RESET = 0x27
REQ_PARK = 0x28
REQ_RESEED = 0x29
REQ_XATTR = 0x2A
REQ_SETTIME = 0x2B
REQ_DATA = 0x30
REQ_END = 0x31

RSP_PONG = 0x81
RSP_STARTED = 0x82
RSP_STDOUT = 0x83
RSP_STDERR = 0x84
RSP_EXIT = 0x85
RSP_DATA = 0x86
RSP_OK = 0x87
RSP_ERROR = 0x88
RSP_ENTRY = 0x89
RSP_ENTRY2 = 0x8A

# A VM's serial channel only (stream id != 0): one side ends its direction.
FRAME_CLOSE = 0x7F

ERR_GENERIC = 0
ERR_USER = 1
ERR_CWD = 2
ERR_EXEC = 3
ERR_PARKED = 4  # EAGAIN: queued when the listener was parked; nothing of it ran

EXEC_STDIN_STREAM = 0x1
EXEC_PTY = 0x2
EXEC_IDLE = 0x4  # the background CPU class: SCHED_IDLE
FILE_MKDIRS = 0x1
FILE_APPEND = 0x2
FILE_NOFOLLOW = 0x4  # no symbolic link in any component of the path
FILE_RECURSIVE = 0x4

EXIT = struct.Struct("<iiBQQQQQ")
ENTRY_HEAD = struct.Struct("<BIQQ")


def frame(kind: int, payload: bytes = b"", stream: int = 0) -> bytes:
    if len(payload) > MAX_PAYLOAD:
        raise ValueError(f"frame payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return HEADER.pack(len(payload), stream, kind) + payload


def u32(n: int) -> bytes:
    return struct.pack("<I", n)


def u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return u32(len(b)) + b


def strings(items: list[str]) -> bytes:
    return u32(len(items)) + b"".join(string(s) for s in items)


def exec_request(
    argv: list[str],
    env: list[str],
    *,
    user: str,
    cwd: str,
    timeout_ms: int,
    stdout_cap: int,
    stderr_cap: int,
    stdin_stream: bool,
    pty: tuple[int, int] | None = None,
    idle: bool = False,
) -> bytes:
    flags = (EXEC_STDIN_STREAM if stdin_stream else 0) | (EXEC_PTY if pty else 0)
    flags |= EXEC_IDLE if idle else 0
    body = (
        u32(flags)
        + struct.pack("<q", timeout_ms)
        + u64(stdout_cap)
        + u64(stderr_cap)
        + string(user)
        + string(cwd)
        + strings(argv)
        + strings(env)
        + (u32(pty[0]) + u32(pty[1]) if pty else b"")
    )
    return frame(REQ_EXEC, body)


def file_request(kind: int, user: str, path: str, tail: bytes = b"") -> bytes:
    return frame(kind, string(user) + string(path) + tail)


@dataclass(frozen=True)
class Exit:
    exit_code: int
    signal: int
    timed_out: bool
    stdout_bytes: int
    stderr_bytes: int
    cpu_user: float
    cpu_system: float
    max_rss: int


def parse_exit(payload: bytes) -> Exit:
    code, sig, timed_out, out_n, err_n, ut, st, rss = EXIT.unpack(payload[: EXIT.size])
    return Exit(code, sig, bool(timed_out), out_n, err_n, ut / 1e6, st / 1e6, rss * 1024)


@dataclass(frozen=True)
class RemoteError:
    errno: int
    stage: int
    message: str


def parse_error(payload: bytes) -> RemoteError:
    err, stage = struct.unpack_from("<iI", payload)
    return RemoteError(err, stage, payload[8:].decode(errors="replace"))


@dataclass(frozen=True)
class Entry:
    kind: str  # 'f' file, 'd' dir, 'l' symlink, 'o' other
    mode: int
    size: int
    mtime_ns: int
    name: str
    uid: int | None = None  # None: an init older than RSP_ENTRY2
    gid: int | None = None
    target: str | None = None  # a symbolic link's
    xattrs: dict[str, str] | None = None  # its user.* extended attributes


ENTRY2_TAIL = struct.Struct("<III")


def _string_at(payload: bytes, off: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<I", payload, off)
    return payload[off + 4 : off + 4 + n].decode(errors="surrogateescape"), off + 4 + n


def parse_entry(payload: bytes, kind_of_frame: int = RSP_ENTRY) -> Entry:
    kind, mode, size, mtime = ENTRY_HEAD.unpack_from(payload)
    if kind_of_frame != RSP_ENTRY2:
        name = payload[ENTRY_HEAD.size :].decode(errors="surrogateescape")
        return Entry(chr(kind), mode, size, mtime, name)
    uid, gid, _ = ENTRY2_TAIL.unpack_from(payload, ENTRY_HEAD.size)
    name, off = _string_at(payload, ENTRY_HEAD.size + 8)
    target, off = _string_at(payload, off)
    (count,) = struct.unpack_from("<I", payload, off)
    off += 4
    xattrs: dict[str, str] = {}
    for _ in range(min(count, 64)):
        key, off = _string_at(payload, off)
        value, off = _string_at(payload, off)
        xattrs[key] = value
    link = target if chr(kind) == "l" else None
    return Entry(chr(kind), mode, size, mtime, name, uid, gid, link, xattrs)
