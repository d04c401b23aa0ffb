"""The Python side of the exec protocol must match native/proto.h."""

from __future__ import annotations

import re
import struct
from pathlib import Path

from corral.execd import protocol as p

PROTO_H = Path(__file__).resolve().parents[2] / "native" / "proto.h"


def _c_constants() -> dict[str, int]:
    text = PROTO_H.read_text()
    found = {
        m[0]: int(m[1], 0)
        for m in re.findall(r"\b([A-Z_][A-Z0-9_]*)\s*=\s*(0x[0-9a-fA-F]+|\d+)", text)
    }
    found.update(
        {
            m[0]: int(m[1].rstrip("u"), 0)
            for m in re.findall(r"#define\s+([A-Z_]+)\s+(0x[0-9a-fA-F]+u?|\d+u?)\b", text)
        }
    )
    return found


def test_constants_match_the_c_header() -> None:
    c = _c_constants()
    names = [
        n for n in dir(p) if n.startswith(("REQ_", "RSP_", "ERR_", "EXEC_", "FILE_", "FRAME_"))
    ]
    assert names
    for name in names:
        assert c[name] == getattr(p, name), name
    assert c["CORRAL_PROTO_VERSION"] == p.VERSION
    assert c["FRAME_HEADER"] == p.HEADER.size


def test_frame_layout() -> None:
    f = p.frame(p.REQ_PING, b"abc")
    assert f == struct.pack("<IIB", 3, 0, p.REQ_PING) + b"abc"


def test_exec_request_encodes_every_field() -> None:
    f = p.exec_request(
        ["sh", "-c", "true"],
        ["A=1"],
        user="root",
        cwd="/w",
        timeout_ms=1500,
        stdout_cap=10,
        stderr_cap=20,
        stdin_stream=True,
    )
    length, _stream, kind = p.HEADER.unpack_from(f)
    body = f[p.HEADER.size :]
    assert kind == p.REQ_EXEC and length == len(body)
    flags, timeout, out_cap, err_cap = struct.unpack_from("<IqQQ", body)
    assert (flags, timeout, out_cap, err_cap) == (p.EXEC_STDIN_STREAM, 1500, 10, 20)
    assert b"root" in body and b"/w" in body and b"A=1" in body


def test_parse_exit_and_entry() -> None:
    x = p.parse_exit(p.EXIT.pack(-1, 9, 1, 5, 6, 2_000_000, 500_000, 1024))
    assert (x.exit_code, x.signal, x.timed_out) == (-1, 9, True)
    assert x.cpu_user == 2.0 and x.cpu_system == 0.5 and x.max_rss == 1024 * 1024
    e = p.parse_entry(p.ENTRY_HEAD.pack(ord("d"), 0o40755, 4096, 10**9) + b"dir")
    assert (e.kind, e.name, e.size, e.mtime_ns) == ("d", "dir", 4096, 10**9)


def test_oversized_frames_are_refused() -> None:
    import pytest

    with pytest.raises(ValueError):
        p.frame(p.REQ_DATA, b"x" * (p.MAX_PAYLOAD + 1))
