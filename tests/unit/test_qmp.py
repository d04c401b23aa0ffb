"""The QMP client against a scripted peer on a unix socket: answers are
matched by id past events and stray replies, and every wait is bounded, so
a QEMU that accepts but never answers fails its caller instead of holding
it (a create once hung a CI run for 300 s on such a socket)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from corral.errors import SandboxFailed
from corral.runtimes.vm.qmp import Qmp

GREETING = b'{"QMP": {"version": {}, "capabilities": []}}\n'
Peer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def _qemu(tmp_path: Path, peer: Peer) -> AsyncIterator[Path]:
    path = tmp_path / "qmp.sock"
    handlers: set[asyncio.Task[None]] = set()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            await peer(reader, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass  # the client hung up, or the test ended
        finally:
            writer.close()

    server = await asyncio.start_unix_server(handle, str(path))
    try:
        yield path
    finally:
        server.close()
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ret: object) -> None:
    msg = json.loads(await reader.readline())
    writer.write(json.dumps({"return": ret, "id": msg["id"]}).encode() + b"\n")
    await writer.drain()


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(30)


async def _greets_then_silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(GREETING)
    await _answer(reader, writer, {})
    await asyncio.sleep(30)


async def _greets_then_events(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(GREETING)
    await _answer(reader, writer, {})
    await reader.readline()
    for _ in range(3000):  # events, never the answer: they must not hold the caller
        writer.write(b'{"event": "RTC_CHANGE", "data": {}}\n')
        await writer.drain()
        await asyncio.sleep(0.005)


async def _closes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(GREETING)
    await _answer(reader, writer, {})
    await reader.readline()
    writer.close()


async def _well(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(GREETING)
    await _answer(reader, writer, {})
    msg = json.loads(await reader.readline())
    writer.write(b'{"event": "STOP", "data": {}}\n')
    writer.write(json.dumps({"return": {}, "id": msg["id"] - 1}).encode() + b"\n")  # stray
    writer.write(json.dumps({"return": {"status": "paused"}, "id": msg["id"]}).encode() + b"\n")
    msg = json.loads(await reader.readline())
    writer.write(json.dumps({"error": {"desc": "no"}, "id": msg["id"]}).encode() + b"\n")
    await writer.drain()
    await asyncio.sleep(1)


async def test_an_answer_is_found_past_events_and_stray_replies(tmp_path: Path) -> None:
    async with _qemu(tmp_path, _well) as path:
        qmp = await Qmp.connect(path, timeout=2, reply_timeout=2)
        try:
            assert await qmp.status() == "paused"
            with pytest.raises(SandboxFailed, match="QEMU refused cont: no"):
                await qmp.execute("cont")
        finally:
            qmp.close()


@pytest.mark.parametrize(
    ("peer", "message"),
    [
        (_silent, "no answer to its greeting"),
        (_greets_then_silent, "no answer to query-status"),
        (_greets_then_events, "no answer to query-status"),
        (_closes, "closed its control socket"),
    ],
    ids=["never greets", "never answers", "only events", "closes"],
)
async def test_a_qemu_that_stops_answering_fails_its_caller_in_bounded_time(
    tmp_path: Path, peer: Peer, message: str
) -> None:
    async with _qemu(tmp_path, peer) as path:
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(SandboxFailed, match=message):
            qmp = await Qmp.connect(path, timeout=0.3, reply_timeout=0.3)
            try:
                await qmp.status()
            finally:
                qmp.close()
        # Far below the peers' 30 s: the bound, not the peer, ended the wait.
        assert loop.time() - began < 10


async def test_no_socket_fails_after_the_connect_timeout(tmp_path: Path) -> None:
    with pytest.raises(SandboxFailed, match="never answered"):
        await Qmp.connect(tmp_path / "absent.sock", timeout=0.1)
