"""The live view's parts that need no VM: its tokens, the read-only
filter over the viewer's RFB stream and the gateway's page proxy."""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Any

import aiohttp
import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from corral.api import liveviewproxy, viewtoken
from corral.api.liveview import ViewOpening, add_live_view
from corral.api.rfb import ViewerStream
from corral.errors import InvalidArgument, Unauthenticated

KEY = b"k" * 32
HANDSHAKE = b"RFB 003.008\n" + b"\x01" + b"\x00"  # version, security None, ClientInit exclusive
SET_ENCODINGS = struct.pack(">BBHii", 2, 0, 2, 0, -258)
UPDATE = struct.pack(">BBHHHH", 3, 1, 0, 0, 1024, 768)
PIXEL_FORMAT = bytes([0, 0, 0, 0]) + bytes(16)
KEY_EVENT = struct.pack(">BBHI", 4, 1, 0, 0x61)
POINTER = struct.pack(">BBHH", 5, 1, 10, 20)
CUT = struct.pack(">BxxxI", 6, 3) + b"abc"
EXT_CLIPBOARD = struct.pack(">Bxxxi", 6, -8) + bytes(8)  # noVNC's extended clipboard caps
QEMU_KEY = struct.pack(">BBHII", 255, 0, 1, 0x61, 0x1E)
FENCE = struct.pack(">BxxxIB", 248, 0, 2) + b"xy"


def test_a_read_only_view_passes_what_asks_to_see_and_drops_input() -> None:
    s = ViewerStream(interactive=False)
    out = s.feed(HANDSHAKE)
    assert out == b"RFB 003.008\n\x01\x01"  # ClientInit forced to shared
    stream = (
        PIXEL_FORMAT + SET_ENCODINGS + EXT_CLIPBOARD + UPDATE + KEY_EVENT + POINTER + CUT
        + QEMU_KEY + FENCE + UPDATE
    )  # fmt: skip
    assert s.feed(stream) == PIXEL_FORMAT + SET_ENCODINGS + UPDATE + FENCE + UPDATE


def test_an_interactive_view_passes_everything_framed_byte_by_byte() -> None:
    s = ViewerStream(interactive=True)
    stream = HANDSHAKE + PIXEL_FORMAT + KEY_EVENT + POINTER + CUT + QEMU_KEY + UPDATE
    out = b"".join(s.feed(stream[i : i + 1]) for i in range(len(stream)))
    assert out == stream[:13] + b"\x01" + stream[14:]


def test_rfb_3_3_has_no_security_choice() -> None:
    s = ViewerStream(interactive=False)
    assert s.feed(b"RFB 003.003\n\x00" + POINTER + UPDATE) == b"RFB 003.003\n\x01" + UPDATE


@pytest.mark.parametrize(
    "stream",
    [
        b"HTTP/1.1 200 OK\r\n\r\n",  # not RFB
        HANDSHAKE + b"\x07" + bytes(16),  # an unknown message type
        HANDSHAKE + struct.pack(">BBHII", 255, 1, 0, 0, 0),  # a QEMU message we cannot frame
        HANDSHAKE + struct.pack(">BxxxI", 6, 1 << 30),  # 1 GiB of "clipboard"
    ],
)
def test_streams_a_view_cannot_frame_end_it(stream: bytes) -> None:
    with pytest.raises(InvalidArgument) as e:
        ViewerStream(interactive=False).feed(stream)
    assert e.value.field == "rfb"


def test_view_tokens_grant_one_sandbox_on_one_node_until_they_expire() -> None:
    token, expires = viewtoken.issue(KEY, "sbx-1", "node-a", False, 60)
    grant = viewtoken.verify(KEY, token, "node-a")
    assert (grant.sandbox_id, grant.interactive, grant.expires_at) == ("sbx-1", False, expires)
    live, _ = viewtoken.issue(KEY, "sbx-1", "node-a", True, 60)
    assert viewtoken.verify(KEY, live, "node-a").interactive
    payload, mac = token.removeprefix("vt1.").split(".")
    bad: list[tuple[str, str, Any]] = [
        (token, "node-b", "for node node-a"),
        (token.replace("vt1.", "dt1."), "node-a", "vt1.<payload>.<mac>"),
        (f"vt1.{payload}", "node-a", "vt1.<payload>.<mac>"),
        (f"vt1.{payload}.{mac[::-1]}", "node-a", "signature"),
        (f"vt1.{live.split('.')[1]}.{mac}", "node-a", "signature"),  # read-only mac, live grant
        ("vt1.bm90IGpzb24.x", "node-a", "signature"),
    ]
    for text, node, why in bad:
        with pytest.raises(Unauthenticated, match=why):
            viewtoken.verify(KEY, text, node)
    with pytest.raises(Unauthenticated, match="signature"):
        viewtoken.verify(b"other" * 7, token, "node-a")


def test_expired_view_tokens_and_bad_ttls(monkeypatch: pytest.MonkeyPatch) -> None:
    token, expires = viewtoken.issue(KEY, "sbx-1", "node-a", False, 1)
    monkeypatch.setattr(time, "time", lambda: expires + 5)
    with pytest.raises(Unauthenticated, match="expired 5 s ago"):
        viewtoken.verify(KEY, token, "node-a")
    for ttl in (0, -1, 3601, True, 1.5):
        with pytest.raises(InvalidArgument) as e:
            viewtoken.issue(KEY, "s", "n", False, ttl)  # type: ignore[arg-type]
        assert e.value.field == "ttl"


def test_a_gateway_reads_the_node_from_a_token_only_to_route() -> None:
    token, _ = viewtoken.issue(b"k" * 32, "sbx-1", "node-7", False, 60)
    assert viewtoken.node_of(token) == "node-7"
    forged = token[: token.rindex(".")] + ".forged"
    assert viewtoken.node_of(forged) == "node-7"  # routed; the node refuses it
    with pytest.raises(Unauthenticated):
        viewtoken.verify(b"k" * 32, forged, "node-7")
    for bad in ["", "vt1.", "vt1.!!!.x", "vt1.W10.x", "vt1.e30.x", "garbage"]:
        with pytest.raises(Unauthenticated):
            viewtoken.node_of(bad)


def test_only_an_interactive_view_counts_the_input_it_passes() -> None:
    live, watch = ViewerStream(interactive=True), ViewerStream(interactive=False)
    for s in (live, watch):
        s.feed(HANDSHAKE + UPDATE + KEY_EVENT + POINTER + UPDATE)
    assert (live.inputs, watch.inputs) == (2, 0)


class _Screen:
    """A VNC server that never speaks: what the viewer sends is kept."""

    def __init__(self) -> None:
        self.got = b""
        self.closed = asyncio.Event()

    async def read(self, n: int) -> bytes:
        await self.closed.wait()
        return b""

    def write(self, data: bytes) -> None:
        self.got += data

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        self.closed.set()


@pytest.mark.parametrize("interactive", [True, False])
def test_a_viewer_driving_the_desktop_marks_it_used(interactive: bool) -> None:
    """The idle policy must not suspend a desktop someone drives through the
    view; watching it is not use."""
    screen, touches = _Screen(), []
    grant = viewtoken.ViewGrant("s1", interactive, time.time() + 60)

    async def open_view(token: str) -> ViewOpening:
        async def opened() -> _Screen:
            return screen

        return ViewOpening(grant, opened, lambda: touches.append(time.monotonic()))

    app = FastAPI()
    add_live_view(app, open_view)
    with TestClient(app) as client, client.websocket_connect("/view/t/websocket") as ws:
        ws.send_bytes(HANDSHAKE + UPDATE)
        for _ in range(20):  # a stream of pointer moves: marked once a second at most
            ws.send_bytes(POINTER)
        ws.send_bytes(UPDATE)
        deadline = time.monotonic() + 5
        while screen.got.count(UPDATE) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert screen.got.count(UPDATE) == 2
    assert len(touches) == (1 if interactive else 0)


async def test_a_gateway_answers_a_view_page_whose_node_is_stuck_or_gone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The page is one small answer: a node that takes the request and says
    nothing gets a 504 after the bound, one that is not there a 502; before,
    the gateway's request waited for ever."""
    monkeypatch.setattr(
        liveviewproxy, "PAGE_TIMEOUT", aiohttp.ClientTimeout(total=0.5, connect=0.5)
    )
    held: list[asyncio.StreamWriter] = []

    async def silent(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        held.append(w)  # takes the request, answers nothing

    stuck = await asyncio.start_server(silent, "127.0.0.1", 0)
    stuck_port = stuck.sockets[0].getsockname()[1]
    gone = await asyncio.start_server(silent, "127.0.0.1", 0)
    gone_port = gone.sockets[0].getsockname()[1]
    gone.close()
    await gone.wait_closed()
    urls = {"stuck": f"http://127.0.0.1:{stuck_port}", "gone": f"http://127.0.0.1:{gone_port}"}

    async def node_url(name: str) -> str:
        return urls[name]

    app = FastAPI()
    close = liveviewproxy.add_live_view_proxy(app, node_url)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            for node, status in (("stuck", 504), ("gone", 502)):
                token, _ = viewtoken.issue(b"k" * 32, "sbx-1", node, False, 60)
                async with asyncio.timeout(10):
                    r = await c.get(f"/view/{token}")
                assert r.status_code == status, (node, r.text)
    finally:
        await close()
        for w in held:
            w.close()
        stuck.close()
        await stuck.wait_closed()
