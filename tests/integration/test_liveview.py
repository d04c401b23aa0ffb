"""A desktop's live view in a real browser: headless Chromium opens the
URL `sbx.display.view()` gives (served by `corral serve`), noVNC draws the
sandbox's screen on its canvas, and what the viewer does reaches the
sandbox only when the view is interactive. Tokens that are wrong, for
another sandbox's node, or expired are refused with the reason."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

import corral
from corral.api.direct import b64url
from corral.config import NodeConfig
from corral.runtimes.vm import desktop

from ..framework import Cluster, Node, require_image
from ..framework.browser import chromium

pytestmark = pytest.mark.integration

KEY = "view-test-key"
XEV = "DISPLAY=:0 xev -geometry 300x200+600+400 -event button -event keyboard >/tmp/xev.log"


@pytest.fixture(scope="module")
def node(node_config: NodeConfig, data_root: Path) -> Iterator[Node]:
    n = Node(replace(node_config, data_dir=data_root / "view", node="view"),
             serve_env={"CORRAL_API_KEY": KEY})  # fmt: skip
    n.server.start()
    try:
        yield n
    finally:
        n.server.stop()
        n.close()


@pytest.fixture(params=[pytest.param("fullvm", marks=pytest.mark.requires_qemu), "container"])
async def desk(node: Node, request: pytest.FixtureRequest) -> AsyncIterator[corral.AsyncSandbox]:
    """A full VM's desktop (QEMU's VNC server) and a container's (x11vnc
    started in the sandbox for each view)."""
    require_image(desktop.BASE)
    async with corral.AsyncClient(node.server.tcp_url, api_key=KEY) as c:
        s = await c.sandboxes.create(
            kind=request.param, image=desktop.BASE, toolkit=[desktop.TOOLKIT], memory="1GiB",
            display_size="1024x768",
        )  # fmt: skip
        try:
            yield s
        finally:
            await s.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium((1100, 900)) as b:
        yield b


def _canvas_pixel(b: Any, x: int, y: int) -> tuple[int, int, int] | None:
    """A pixel of noVNC's canvas (framebuffer coordinates), once connected."""
    got = b.execute_script(
        "const c = document.querySelector('#screen canvas');"
        "if (document.body.dataset.state !== 'connected' || !c) return null;"
        "const d = c.getContext('2d').getImageData(arguments[0], arguments[1], 1, 1).data;"
        "return [d[0], d[1], d[2], c.width, c.height];",
        x,
        y,
    )
    if got is None or (got[3], got[4]) != (1024, 768):
        return None
    return int(got[0]), int(got[1]), int(got[2])


def _until(what: str, ok: Any, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = ok()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def _click_canvas(b: Any, x: int, y: int) -> None:
    """A real click in the browser at framebuffer (x, y) of the scaled canvas."""
    from selenium.webdriver.common.actions.action_builder import ActionBuilder

    left, top, w, h = b.execute_script(
        "const r = document.querySelector('#screen canvas').getBoundingClientRect();"
        "return [r.left, r.top, r.width, r.height];"
    )
    actions = ActionBuilder(b)
    actions.pointer_action.move_to_location(int(left + x * w / 1024), int(top + y * h / 768))
    actions.pointer_action.click()
    actions.perform()


async def _xev_ready(s: corral.AsyncSandbox) -> None:
    await s.commands.start(XEV)
    deadline = time.monotonic() + 60
    while not [w for w in await s.display.windows() if w.title == "Event Tester"]:
        assert time.monotonic() < deadline, "xev's window never appeared"
        await asyncio.sleep(0.5)


async def test_the_view_shows_the_desktop_and_only_an_interactive_one_drives_it(
    desk: corral.AsyncSandbox, browser: Any
) -> None:
    await _xev_ready(desk)
    view = await desk.display.view()
    assert view.url and view.url.endswith(view.path) and not view.interactive
    assert 0 < view.expires_at - time.time() <= 300
    browser.get(view.url)
    # noVNC drew the sandbox's screen: the desktop's background colour.
    _until(
        "the desktop's colour on the canvas",
        lambda: _canvas_pixel(browser, 100, 700) == desktop.DESKTOP_RGB,
    )
    # Read-only: a click in the browser never reaches the guest.
    _click_canvas(browser, 750, 500)
    await asyncio.sleep(2)
    assert "ButtonPress" not in (await desk.files.read("/tmp/xev.log")).decode()
    # Interactive: the same click does.
    live = await desk.display.view(interactive=True, ttl=60)
    browser.get(live.url)
    _until("the interactive view", lambda: _canvas_pixel(browser, 100, 700) == desktop.DESKTOP_RGB)
    _click_canvas(browser, 750, 500)
    deadline = time.monotonic() + 20
    while "ButtonPress" not in (await desk.files.read("/tmp/xev.log")).decode():
        assert time.monotonic() < deadline, "the interactive view's click never arrived"
        await asyncio.sleep(0.5)


async def test_bad_view_tokens_are_refused_with_the_reason(
    node: Node, desk: corral.AsyncSandbox
) -> None:
    view = await desk.display.view(ttl=1)
    base = node.server.tcp_url
    payload, mac = view.token.removeprefix("vt1.").split(".")
    cases = [
        ("vt1.nope", "vt1.<payload>.<mac>"),
        (f"vt1.{payload}.{mac[:-2]}AA", "signature"),
        ("dt1.x.y", "vt1.<payload>.<mac>"),
    ]
    async with httpx.AsyncClient(base_url=base) as h:
        for token, why in cases:
            r = await h.get(f"/view/{token}")
            assert r.status_code == 401, token
            assert why in r.json()["error"]["message"], (token, r.text)
        await asyncio.sleep(1.5)
        r = await h.get(view.path)  # expired now
        assert r.status_code == 401 and "expired" in r.json()["error"]["message"]
    for bad in ({"ttl": 0}, {"ttl": 3601}):
        with pytest.raises(corral.InvalidArgument) as e:
            await desk.display.view(**bad)
        assert e.value.field == "ttl"


async def test_a_view_needs_a_display_and_a_server(embedded: corral.AsyncClient) -> None:
    box = await embedded.sandboxes.create(image="debian-python:bookworm")
    try:
        with pytest.raises(corral.InvalidArgument) as e:
            await box.display.view()
        assert e.value.field == "display_size"
    finally:
        await box.close()


@pytest.fixture(scope="module")
def cluster(data_root: Path) -> Iterator[Cluster]:
    c = Cluster(data_root / "vc", nodes=1, prefix="v", net_offset=7)
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.mark.requires_postgres
@pytest.mark.requires_qemu
async def test_the_view_through_a_gateway(cluster: Cluster, browser: Any) -> None:
    """The gateway relays the page and the socket to the node the token
    names; the node still checks the token and still filters the input."""
    require_image(desktop.BASE)
    async with cluster.client(cluster.project("views")) as c:
        s = await c.sandboxes.create(
            kind="fullvm", image=desktop.BASE, toolkit=[desktop.TOOLKIT], memory="1GiB"
        )
        try:
            view = await s.display.view()
            assert cluster.gateway is not None
            gateway = cluster.gateway.url
            assert view.url == gateway + view.path
            async with httpx.AsyncClient() as h:
                page = await h.get(view.url)
                assert page.status_code == 200 and "read-only" in page.text
                assert "nonce-" in page.headers["content-security-policy"]
                # The socket speaks RFB from the sandbox's VNC server, via the node.
                async with aiohttp.ClientSession() as session:
                    ws_url = gateway.replace("http", "ws", 1) + view.path + "/websocket"
                    async with session.ws_connect(ws_url, protocols=("binary",)) as ws:
                        first = await ws.receive(timeout=30)
                        assert first.type == aiohttp.WSMsgType.BINARY
                        assert first.data.startswith(b"RFB 003.0")
                # Refused at the node, with its reason; an unknown node at the gateway.
                payload, _, mac = view.token.removeprefix("vt1.").partition(".")
                forged = f"vt1.{payload}.{'A' * len(mac)}"
                r = await h.get(f"{gateway}/view/{forged}")
                assert r.status_code == 401 and "signature" in r.text
                elsewhere = b64url(b'{"s":"x","n":"nowhere","i":true,"e":9e9}')
                r = await h.get(f"{gateway}/view/vt1.{elsewhere}.{mac}")
                assert r.status_code == 404 and "nowhere" in r.text
                r = await h.get(f"{gateway}/view/garbage")
                assert r.status_code == 401
            browser.get(view.url)
            _until(
                "the desktop's colour on the canvas, through the gateway",
                lambda: _canvas_pixel(browser, 100, 700) == desktop.DESKTOP_RGB,
            )
        finally:
            await s.close()
