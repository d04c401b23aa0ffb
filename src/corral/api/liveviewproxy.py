"""A desktop's live view through a gateway: the same `/view/<token>` page
and socket as on the node (api/liveview.py), relayed to the node the token
names.

The gateway holds no view key: it reads the node's name from the token
only to route (an unknown node is a 404), and the node checks the token
as it would for a browser that reached it directly, so a forged or
expired token is refused there, with the node's reason passed back. The
socket is relayed frame for frame, both ways, until either side closes;
the node's read-only filter and expiry stay in force because every byte
still goes through the node's bridge. noVNC's files are served from the
gateway's own copy (Debian's `novnc`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import aiohttp
from fastapi import FastAPI, WebSocket
from fastapi.responses import PlainTextResponse, Response

from corral import metrics
from corral.api import viewtoken
from corral.api.liveview import mount_novnc
from corral.api.wire import as_corral
from corral.errors import CorralError
from corral.log import get_logger

log = get_logger("corral.view.proxy")

NodeUrl = Callable[[str], Awaitable[str]]  # node name -> its base URL; NotFound if none
PASSED_HEADERS = (
    "content-type", "cache-control", "referrer-policy", "content-security-policy",
)  # fmt: skip
# The relay is long-lived (the node ends it when its grant expires); a
# page is one small answer, bounded so a stuck node cannot hold the request.
TIMEOUT = aiohttp.ClientTimeout(total=None, connect=10, sock_read=None)
PAGE_TIMEOUT = aiohttp.ClientTimeout(total=30, connect=10)


def _ws_url(base: str, token: str) -> str:
    return base.rstrip("/").replace("http", "ws", 1) + f"/view/{token}/websocket"


def add_live_view_proxy(app: FastAPI, node_url: NodeUrl) -> Callable[[], Awaitable[None]]:
    """Adds the routes; returns what closes their client (at shutdown)."""
    mount_novnc(app)
    session: dict[str, aiohttp.ClientSession] = {}

    def client() -> aiohttp.ClientSession:
        if "s" not in session or session["s"].closed:
            session["s"] = aiohttp.ClientSession(timeout=TIMEOUT)
        return session["s"]

    @app.get("/view/{token}")
    async def view_page(token: str) -> Response:
        base = await node_url(viewtoken.node_of(token))
        try:
            async with client().get(f"{base.rstrip('/')}/view/{token}", timeout=PAGE_TIMEOUT) as r:
                body = await r.read()
                headers = {k: v for k, v in r.headers.items() if k.lower() in PASSED_HEADERS}
                return Response(body, status_code=r.status, headers=headers)
        except TimeoutError:
            return PlainTextResponse("the sandbox's node did not answer in time", 504)
        except aiohttp.ClientError:
            # Not the client's error text: it names the node's address.
            return PlainTextResponse("the sandbox's node could not be reached", 502)

    @app.websocket("/view/{token}/websocket")
    async def view_socket(ws: WebSocket, token: str) -> None:
        offered = ws.scope.get("subprotocols", [])
        try:
            base = await node_url(viewtoken.node_of(token))
            upstream = await client().ws_connect(
                _ws_url(base, token), protocols=("binary",) if "binary" in offered else ()
            )
        except (CorralError, aiohttp.ClientError, OSError) as exc:
            await ws.close(code=1008, reason=as_corral(exc).message[:120])
            return
        await ws.accept(subprotocol=upstream.protocol)
        metrics.DISPLAY_OPS.labels("view_relay").inc()

        async def viewer_to_node() -> None:
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    return
                if msg.get("bytes") is not None:
                    await upstream.send_bytes(msg["bytes"])
                elif msg.get("text") is not None:
                    await upstream.send_str(msg["text"])

        closed: dict[str, object] = {"code": 1000, "reason": "closed"}

        async def node_to_viewer() -> None:
            while True:
                msg = await upstream.receive()
                if msg.type == aiohttp.WSMsgType.BINARY:
                    await ws.send_bytes(msg.data)
                elif msg.type == aiohttp.WSMsgType.TEXT:
                    await ws.send_text(msg.data)
                else:
                    # The node's close (expired, refused) is the viewer's.
                    if msg.type == aiohttp.WSMsgType.CLOSE:
                        closed.update(code=int(msg.data), reason=str(msg.extra or ""))
                    return

        tasks = [asyncio.create_task(viewer_to_node()), asyncio.create_task(node_to_viewer())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await upstream.close()
            code = closed["code"]
            code = code if isinstance(code, int) and 1000 <= code < 5000 else 1011
            with contextlib.suppress(RuntimeError):
                await ws.close(code=code, reason=str(closed["reason"])[:120])
            log.info("view.relayed", node=viewtoken.node_of(token), why=closed["reason"])

    async def aclose() -> None:
        if "s" in session:
            await session["s"].close()

    return aclose
