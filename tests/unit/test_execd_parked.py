"""A request that a change of its sandbox left unanswered is sent again once
the change has ended, and only then (execd/client.py `_exchange`): a save
parks the exec server, whose queued connections are told ERR_PARKED or
reset. Against a scripted server: what each connection gets is a table."""

from __future__ import annotations

import asyncio
import errno
import struct
from pathlib import Path

import pytest

from corral.errors import FileError, Unavailable
from corral.execd import client as execd
from corral.execd import protocol as p

PARKED = p.frame(p.RSP_ERROR, struct.pack("<iI", errno.EAGAIN, p.ERR_PARKED) + b"parked")
BUSY = p.frame(p.RSP_ERROR, struct.pack("<iI", errno.EAGAIN, p.ERR_GENERIC) + b"busy")
ENDS = {p.REQ_WRITE: p.REQ_END, p.REQ_EXEC: p.REQ_STDIN_EOF}  # request: its last frame
ENTRY = p.frame(p.RSP_ENTRY, p.ENTRY_HEAD.pack(ord("f"), 0o644, 3, 0) + b"f")


class Scripted:
    """Answers the n-th connection with script[n] (the last one repeats):
    a frame, or None to read the request and close unanswered. Keeps what
    each connection sent."""

    def __init__(self, script: list[bytes | None]) -> None:
        self.script = script
        self.requests: list[bytes] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answer = self.script[min(len(self.requests), len(self.script) - 1)]
        got, last = b"", None
        while True:  # the whole request: a write's body, a command's stdin
            head = await reader.readexactly(p.HEADER.size)
            length, _s, kind = p.HEADER.unpack(head)
            got += head + await reader.readexactly(length)
            last = last or ENDS.get(kind)
            if last is None or kind == last:
                break
        self.requests.append(got)
        if answer is not None:
            writer.write(answer)
            await writer.drain()
        writer.close()


class Changes:
    """A settle callback: says a change was in flight `times` times."""

    def __init__(self, times: int) -> None:
        self.left = times
        self.calls = 0

    async def __call__(self) -> bool:
        self.calls += 1
        self.left -= 1
        return self.left >= 0


async def _client(
    tmp_path: Path, script: list[bytes | None], changes: Changes | None
) -> tuple[execd.ExecdClient, Scripted, asyncio.Server]:
    server = Scripted(script)
    listening = await asyncio.start_unix_server(server.serve, path=str(tmp_path / "s"))
    return execd.ExecdClient(str(tmp_path / "s"), settle=changes), server, listening


@pytest.mark.parametrize(
    ("first", "name"), [(PARKED, "parked"), (None, "reset")], ids=["parked", "reset"]
)
async def test_a_request_left_unanswered_by_a_change_is_sent_again_after_it(
    tmp_path: Path, first: bytes | None, name: str
) -> None:
    changes = Changes(1)
    client, server, listening = await _client(tmp_path, [first, ENTRY], changes)
    entry = await client.stat("root", "/f")
    assert (entry.name, entry.size) == ("f", 3), name
    assert changes.calls == 1
    assert len(server.requests) == 2 and server.requests[0] == server.requests[1]
    listening.close()


async def test_a_write_is_sent_again_whole(tmp_path: Path) -> None:
    client, server, listening = await _client(
        tmp_path, [PARKED, p.frame(p.RSP_OK, p.u64(300_000))], Changes(1)
    )
    data = bytes(range(256)) * 1200  # more than one chunk
    assert await client.write("root", "/f", data, max_bytes=1 << 20) == 300_000
    assert len(server.requests) == 2 and server.requests[0] == server.requests[1]
    assert data[:1000] in server.requests[1] and len(server.requests[1]) > len(data)
    listening.close()


async def test_a_command_with_stdin_is_sent_again_whole(tmp_path: Path) -> None:
    client, server, listening = await _client(
        tmp_path, [None, p.frame(p.RSP_STARTED, p.u32(42))], Changes(1)
    )
    session = await client.start(
        ["cat"], [], user="root", cwd="/", timeout=None, stdout_cap=1, stderr_cap=1,
        stdin=b"input",
    )  # fmt: skip
    assert session.pid == 42
    session.close()
    assert len(server.requests) == 2 and server.requests[0] == server.requests[1]
    assert b"input" in server.requests[1]
    listening.close()


@pytest.mark.parametrize(
    ("script", "changes", "error", "match", "connections"),
    [
        # Parked, and no change to wait for: said so, not retried.
        ([PARKED], None, Unavailable, "is parked: try again", 1),
        ([PARKED], Changes(0), Unavailable, "is parked: try again", 1),
        # Closed unanswered with no change in flight: the sandbox's doing.
        ([None], None, ConnectionError, "closed the connection", 1),
        ([None], Changes(0), ConnectionError, "closed the connection", 1),
        # Parked on every try: three, then given up.
        ([PARKED], Changes(10), Unavailable, "parked again and again", 3),
        # An EAGAIN that is not a park is the request's own answer.
        ([BUSY], Changes(10), FileError, "busy", 1),
    ],
    ids=["parked-no-settle", "parked-no-change", "reset-no-settle", "reset-no-change",
         "parked-always", "eagain-not-parked"],
)  # fmt: skip
async def test_what_is_not_sent_again(
    tmp_path: Path,
    script: list[bytes | None],
    changes: Changes | None,
    error: type[Exception],
    match: str,
    connections: int,
) -> None:
    client, server, listening = await _client(tmp_path, script, changes)
    with pytest.raises(error, match=match):
        await client.stat("root", "/f")
    assert len(server.requests) == connections
    listening.close()
