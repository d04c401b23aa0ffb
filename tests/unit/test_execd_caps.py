"""The host holds an exec server to what it asked for (issue 14, class 8):
a VM guest's root can speak the agent protocol itself, so every answer is
capped on the host, whatever the server sends, and every wait on it is
bounded, whatever the server withholds."""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from corral.errors import FileError, Unavailable
from corral.execd import client as execd
from corral.execd import protocol as p

Answer = Callable[[asyncio.StreamWriter], Awaitable[None]]


_handlers: set[asyncio.Task[None]] = set()


async def _stop(server: asyncio.Server) -> None:
    """Close the server once its handlers have seen their clients go."""
    server.close()
    loop = asyncio.get_running_loop()
    async with asyncio.timeout(5):
        await asyncio.gather(*(t for t in _handlers if t.get_loop() is loop),
                             return_exceptions=True)  # fmt: skip


async def _server(sock: Path, answer: Answer) -> asyncio.Server:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        _handlers.add(task)
        task.add_done_callback(_handlers.discard)
        head = await reader.readexactly(p.HEADER.size)
        length, _s, _k = p.HEADER.unpack(head)
        await reader.readexactly(length)
        answering = asyncio.ensure_future(answer(writer))
        hung_up = asyncio.ensure_future(reader.read())  # the rest, up to the client's close
        await asyncio.wait({answering, hung_up}, return_when=asyncio.FIRST_COMPLETED)
        for task in (answering, hung_up):
            task.cancel()
        await asyncio.gather(answering, hung_up, return_exceptions=True)
        with contextlib.suppress(ConnectionError):
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


async def _hold(w: asyncio.StreamWriter) -> None:
    await asyncio.sleep(30)  # takes the request, answers nothing


async def _one_frame_then_hold(w: asyncio.StreamWriter) -> None:
    w.write(p.frame(p.RSP_DATA, b"x" * 10))
    await w.drain()
    await asyncio.sleep(30)


async def _trickle(w: asyncio.StreamWriter) -> None:
    w.write(p.frame(p.RSP_STARTED, p.u32(7)))
    for _ in range(600):  # output for ever, never the exit
        w.write(p.frame(p.RSP_STDOUT, b"."))
        await w.drain()
        await asyncio.sleep(0.05)


Call = Callable[[execd.ExecdClient], Awaitable[object]]
REQUESTS: list[tuple[str, Call]] = [
    ("ping", lambda c: c.ping()),
    ("stat", lambda c: c.stat("root", "/f")),
    ("mkdir", lambda c: c.mkdir("root", "/d")),
    ("set_time", lambda c: c.set_time(0)),
    ("write", lambda c: c.write("root", "/f", b"data", max_bytes=100)),
    ("start", lambda c: c.start(["true"], [], user="root", cwd="/", timeout=1,
                                stdout_cap=10, stderr_cap=10, stdin=None)),
]  # fmt: skip


@pytest.mark.parametrize(("name", "call"), REQUESTS, ids=[n for n, _ in REQUESTS])
async def test_a_server_that_takes_a_request_and_never_answers_fails_it_in_bounded_time(
    tmp_path: Path, name: str, call: Call
) -> None:
    """A hung guest, or a hostile one, would otherwise hold a create, a
    resume or a fork that asks it anything."""
    server = await _server(tmp_path / "s", _hold)
    client = execd.ExecdClient(str(tmp_path / "s"), reply_timeout=0.3)
    try:
        with pytest.raises(Unavailable, match=r"gave no answer in 0\.3 s"):
            async with asyncio.timeout(10):  # the bound under test is 0.3 s
                await call(client)
    finally:
        await _stop(server)


async def test_a_read_whose_next_frame_never_comes_fails_in_bounded_time(tmp_path: Path) -> None:
    server = await _server(tmp_path / "s", _one_frame_then_hold)
    client = execd.ExecdClient(str(tmp_path / "s"), reply_timeout=0.3)
    try:
        with pytest.raises(Unavailable, match="gave no answer"):
            async with asyncio.timeout(10):
                await client.read("root", "/f", 1 << 20)
    finally:
        await _stop(server)


async def test_a_platform_command_trickling_output_past_its_timeout_is_cut_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server enforces a command's timeout; one that does not (a
    guest's root speaking for its agent) still ends the host's wait at the
    timeout and a grace, though it never falls silent."""
    monkeypatch.setattr(execd, "RUN_GRACE", 0.3)
    server = await _server(tmp_path / "s", _trickle)
    client = execd.ExecdClient(str(tmp_path / "s"))
    try:
        with pytest.raises(Unavailable, match=r"did not end sh 0\.3 s after its 0\.2 s timeout"):
            async with asyncio.timeout(10):
                await client.run(["sh", "-c", "true"], user="root", timeout=0.2)
    finally:
        await _stop(server)


async def test_stdin_a_server_never_takes_fails_the_start_in_bounded_time(tmp_path: Path) -> None:
    """stdin is sent before the server says the command started; a server
    that never reads it would hold the start for ever."""
    held: list[asyncio.StreamWriter] = []

    async def never_reads(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_unix_server(never_reads, path=str(tmp_path / "s"))
    client = execd.ExecdClient(str(tmp_path / "s"))
    try:
        with pytest.raises(Unavailable, match=r"took no stdin in 0\.3 s"):
            async with asyncio.timeout(10):
                await client.start(
                    ["cat"], [], user="root", cwd="/", timeout=1, stdout_cap=10,
                    stderr_cap=10, stdin=b"x" * (16 << 20), stdin_timeout=0.3,
                )  # fmt: skip
    finally:
        for w in held:
            w.close()
        server.close()


async def test_a_listing_past_its_byte_budget_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Few entries, each huge (a guest's agent writes what it likes; a
    container's xattrs are 32 x 4 KiB an entry): refused at the budget,
    not held."""
    monkeypatch.setattr(execd, "MAX_LIST_BYTES", 10_000)
    entry = p.ENTRY_HEAD.pack(ord("f"), 0o644, 1, 0) + b"n" * 4000

    async def fat(w: asyncio.StreamWriter) -> None:
        for _ in range(5):
            w.write(p.frame(p.RSP_ENTRY, entry))
        w.write(p.frame(p.RSP_OK))

    server = await _server(tmp_path / "s", fat)
    with pytest.raises(FileError, match="a listing of more than 10000 bytes"):
        await execd.ExecdClient(str(tmp_path / "s")).list("root", "/")
    server.close()


async def test_a_platform_commands_output_is_capped_on_the_host(tmp_path: Path) -> None:
    """run() asks the server for `cap` bytes a stream; a guest's root,
    speaking for its agent, sends more: the host keeps `cap`."""

    async def flood(w: asyncio.StreamWriter) -> None:
        w.write(p.frame(p.RSP_STARTED, p.u32(7)))
        for _ in range(64):
            w.write(p.frame(p.RSP_STDOUT, b"o" * 65536))
            w.write(p.frame(p.RSP_STDERR, b"e" * 65536))
        w.write(p.frame(p.RSP_EXIT, p.EXIT.pack(0, 0, 0, 0, 0, 0, 0, 0)))
        await w.drain()
        await asyncio.sleep(30)

    server = await _server(tmp_path / "s", flood)
    try:
        async with asyncio.timeout(10):
            _code, out, err = await execd.ExecdClient(str(tmp_path / "s")).run(
                ["true"], user="root", timeout=1, cap=1000
            )
        assert (len(out), len(err)) == (1000, 1000)
    finally:
        await _stop(server)
