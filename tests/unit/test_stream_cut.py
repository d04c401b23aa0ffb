"""A response cut mid-body on purpose (api/wire.py StreamCut: a sandbox's
port server or process went away): on a real uvicorn with Corral's HTTP/1.1
protocol the client sees its connection reset after the bytes that came,
never a chunked body that ends cleanly, and the server logs one info line,
not a traceback or an "unfinished answer" error."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import uvicorn
from fastapi.responses import StreamingResponse

from corral.api.app import create_app
from corral.api.h2c import H2cOrHttp11
from corral.api.wire import StreamCut


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def server() -> Iterator[int]:
    app = create_app(object())  # type: ignore[arg-type]

    async def part_then_cut() -> AsyncIterator[bytes]:
        yield b"the first half"
        raise StreamCut("port 8888 of sandbox t-0 stopped mid-answer")

    async def part_then_bug() -> AsyncIterator[bytes]:
        yield b"the first half"
        raise RuntimeError("a bug")

    app.get("/cut")(lambda: StreamingResponse(part_then_cut()))
    app.get("/bug")(lambda: StreamingResponse(part_then_bug()))
    port = _free_port()
    cfg = uvicorn.Config(
        app, host="127.0.0.1", port=port, http=H2cOrHttp11, lifespan="off", log_config=None
    )
    srv = uvicorn.Server(cfg)
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    while not srv.started:
        time.sleep(0.01)
    yield port
    srv.should_exit = True
    t.join(5)


def _get(port: int, path: str) -> tuple[bytes, str]:
    """What came, and how the connection ended: 'reset' or 'closed'."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        try:
            while chunk := s.recv(65536):
                got += chunk
        except ConnectionResetError:
            return got, "reset"
    return got, "closed"


def test_a_cut_stream_resets_the_connection_and_logs_no_error(
    server: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    got, end = _get(server, "/cut")
    assert b"the first half" in got and end == "reset"
    assert not got.endswith(b"0\r\n\r\n"), "a cut answer must not end like a whole one"
    time.sleep(0.2)  # the server's last log lines
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert errors == [], [r.getMessage() for r in errors]
    assert [r.getMessage() for r in caplog.records if r.name == "corral.api"] == ["api.stream_cut"]


def test_a_bug_mid_stream_is_still_an_error_with_its_traceback(
    server: int, caplog: pytest.LogCaptureFixture
) -> None:
    got, _ = _get(server, "/bug")
    assert b"the first half" in got and not got.endswith(b"0\r\n\r\n")
    time.sleep(0.2)
    unexpected = [r for r in caplog.records if r.getMessage() == "api.unexpected"]
    assert len(unexpected) == 1 and unexpected[0].exc_info is not None
