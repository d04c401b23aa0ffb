"""The host holds an exec server to what it asked for (issue 14, class 8):
a VM guest's root can speak the agent protocol itself, so every answer is
capped on the host, whatever the server sends."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from corral.errors import FileError
from corral.execd import client as execd
from corral.execd import protocol as p

Answer = Callable[[asyncio.StreamWriter], Awaitable[None]]


async def _server(sock: Path, answer: Answer) -> asyncio.Server:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readexactly(p.HEADER.size)
        length, _s, _k = p.HEADER.unpack(head)
        await reader.readexactly(length)
        await answer(writer)
        await writer.drain()
        writer.close()

    return await asyncio.start_unix_server(serve, path=str(sock))


async def test_a_read_answered_with_more_than_asked_is_refused(tmp_path: Path) -> None:
    async def lying(w: asyncio.StreamWriter) -> None:
        for _ in range(5):  # 5 x 1000 bytes against a cap of 4096
            w.write(p.frame(p.RSP_DATA, b"x" * 1000))
        w.write(p.frame(p.RSP_OK))

    server = await _server(tmp_path / "s", lying)
    with pytest.raises(FileError) as exc:
        await execd.ExecdClient(str(tmp_path / "s")).read("root", "/f", 4096)
    assert exc.value.details["errno"] == errno.EFBIG and exc.value.details["refused"] == "reply"
    server.close()


async def test_a_frame_over_the_protocol_cap_is_never_buffered(tmp_path: Path) -> None:
    async def huge(w: asyncio.StreamWriter) -> None:
        w.write(p.HEADER.pack(p.MAX_PAYLOAD + 1, 0, p.RSP_DATA) + b"x" * 1024)

    server = await _server(tmp_path / "s", huge)
    with pytest.raises(ConnectionError):
        await execd.ExecdClient(str(tmp_path / "s")).read("root", "/f", 1 << 30)
    server.close()


async def test_a_listing_past_its_cap_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(execd, "MAX_ENTRIES", 10)
    entry = p.ENTRY_HEAD.pack(ord("f"), 0o644, 1, 0) + b"name"

    async def many(w: asyncio.StreamWriter) -> None:
        for _ in range(11):
            w.write(p.frame(p.RSP_ENTRY, entry))
        w.write(p.frame(p.RSP_OK))

    server = await _server(tmp_path / "s", many)
    with pytest.raises(FileError, match="more than 10 directory entries"):
        await execd.ExecdClient(str(tmp_path / "s")).list("root", "/")
    server.close()
