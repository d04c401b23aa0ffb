"""A desktop sandbox's screen in a browser: `GET /view/<token>` is a page
running noVNC (Debian's `novnc` package, served from /usr/share/novnc),
which opens `/view/<token>/websocket`; that socket is bridged to QEMU's
VNC server for the sandbox, through the read-only filter (api/rfb.py)
unless the token is interactive.

The token (api/viewtoken.py) is checked when the page loads and again
when the socket opens; the bridge closes when it expires. The page names
the sandbox and mode and nothing else; it is sent with no-store,
no-referrer (the token is in the URL) and a CSP that runs only its own
script and noVNC's modules.
"""

from __future__ import annotations

import asyncio
import html
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import NamedTuple

from fastapi import FastAPI, WebSocket
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from corral import metrics
from corral.api import viewtoken
from corral.api.rfb import ViewerStream
from corral.api.wire import as_corral
from corral.errors import CorralError, NotFound
from corral.log import get_logger
from corral.runtimes.vnc import ByteStream

log = get_logger("corral.view")

NOVNC = Path("/usr/share/novnc")


class ViewOpening(NamedTuple):
    """What a view token opens: its grant, the screen's RFB stream, and
    how to mark the sandbox used (a viewer's typing and clicking is use:
    the idle policy must not suspend a desktop someone is driving)."""

    grant: viewtoken.ViewGrant
    open: Callable[[], Awaitable[ByteStream]]
    touch: Callable[[], None]


OpenView = Callable[[str], Awaitable[ViewOpening]]
TOUCH_EVERY = 1.0  # s: a viewer's stream of pointer moves marks use at most this often
CHUNK = 1 << 16

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>Corral: {sandbox} ({mode})</title>
<style>html,body{{margin:0;height:100%;background:#1e1e1e}}#screen{{width:100%;height:100%}}</style>
</head><body data-state="connecting"><div id="screen"></div>
<script type="module" nonce="{nonce}">
import RFB from "/view/novnc/core/rfb.js";
const scheme = location.protocol === "https:" ? "wss://" : "ws://";
const url = scheme + location.host + location.pathname.replace(/\\/$/, "") + "/websocket";
const rfb = new RFB(document.getElementById("screen"), url, {{shared: true}});
rfb.viewOnly = {view_only};
rfb.scaleViewport = true;
rfb.addEventListener("connect", () => {{ document.body.dataset.state = "connected"; }});
rfb.addEventListener("disconnect", () => {{ document.body.dataset.state = "disconnected"; }});
window.corralView = rfb;
</script></body></html>
"""


def mount_novnc(app: FastAPI) -> None:
    """noVNC's modules, what the view page imports: its core and vendored
    libraries only. Not its own pages (vnc.html and the like), which take a
    server and password from their URL: a link to one on this origin would
    connect the operator to any VNC server."""
    if (NOVNC / "core" / "rfb.js").is_file():
        for part in ("core", "vendor"):
            app.mount(
                f"/view/novnc/{part}", StaticFiles(directory=NOVNC / part), name=f"novnc-{part}"
            )


def add_live_view(app: FastAPI, open_view: OpenView) -> None:
    mount_novnc(app)

    @app.get("/view/{token}", response_class=HTMLResponse)
    async def view_page(token: str) -> HTMLResponse:
        grant = (await open_view(token)).grant
        if not (NOVNC / "core" / "rfb.js").is_file():
            raise NotFound(f"the live view's page needs noVNC in {NOVNC} (apt-get install novnc)")
        nonce = secrets.token_urlsafe(16)
        page = PAGE.format(
            sandbox=html.escape(grant.sandbox_id),
            mode="interactive" if grant.interactive else "read-only",
            view_only="false" if grant.interactive else "true",
            nonce=nonce,
        )
        return HTMLResponse(
            page,
            headers={
                "Cache-Control": "no-store",
                "Referrer-Policy": "no-referrer",
                "Content-Security-Policy": (
                    f"default-src 'self'; script-src 'self' 'nonce-{nonce}'; "
                    "style-src 'unsafe-inline'; img-src 'self' data: blob:; "
                    "connect-src 'self'; frame-ancestors 'none'"
                ),
            },
        )

    @app.websocket("/view/{token}/websocket")
    async def view_socket(ws: WebSocket, token: str) -> None:
        try:
            grant, open_stream, touch = await open_view(token)
            screen = await open_stream()
        except (CorralError, OSError) as exc:
            # Policy violation, with the reason: a browser shows the close.
            await ws.close(code=1008, reason=as_corral(exc).message[:120])
            return
        offered = ws.scope.get("subprotocols", [])
        await ws.accept(subprotocol="binary" if "binary" in offered else None)
        metrics.DISPLAY_OPS.labels("view_open").inc()
        log.info("view.open", sandbox=grant.sandbox_id, interactive=grant.interactive)
        stream = ViewerStream(grant.interactive)
        touched = [0.0]  # when the sandbox was last marked used

        async def viewer_to_screen() -> None:
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    return
                data = msg.get("bytes") or (msg.get("text") or "").encode()
                out = stream.feed(data)  # raises on a stream it cannot frame
                if out:
                    screen.write(out)
                    await screen.drain()
                if stream.inputs and time.monotonic() - touched[0] >= TOUCH_EVERY:
                    stream.inputs = 0
                    touched[0] = time.monotonic()
                    touch()

        async def screen_to_viewer() -> None:
            while data := await screen.read(CHUNK):
                await ws.send_bytes(data)

        tasks = [asyncio.create_task(viewer_to_screen()), asyncio.create_task(screen_to_viewer())]
        why = "expired"
        try:
            done, _ = await asyncio.wait(
                tasks,
                timeout=max(0.0, grant.expires_at - time.time()),
                return_when=asyncio.FIRST_COMPLETED,
            )
            for t in done:
                err = t.exception()
                why = f"{type(err).__name__}: {err}" if err else "closed"
        finally:
            for t in tasks:
                t.cancel()
            screen.close()
            try:
                await ws.close(code=1000 if why == "closed" else 1008, reason=why[:120])
            except RuntimeError:
                pass  # the viewer had already gone
            log.info("view.closed", sandbox=grant.sandbox_id, why=why)
