"""The server side of the HTTP API beyond the route table: how an endpoint
finds the service it runs on, reads a raw body under a cap, and streams a
command's events. The generated endpoints (api/endpoints.py) use these;
create_app's CorralApp puts RequestContext in front of them all.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Annotated
from urllib.parse import urlsplit

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral import log, trace
from corral.api.abandoned import AbandonedCreates
from corral.api.h2c import reset_of
from corral.api.models import Event, ExecEvent
from corral.api.routes import MAX_BODY
from corral.api.service import SandboxService
from corral.api.wire import StreamCut, error_line, event_line
from corral.errors import CorralError, InvalidArgument, PermissionDenied


async def _service(request: Request) -> SandboxService:
    """The service this request is for (its caller's view, on a gateway);
    create_app's resolver also checks the caller's key."""
    svc: SandboxService = await request.app.state.resolve(request)
    return svc


Svc = Annotated[SandboxService, Depends(_service)]


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused once it passes `limit` bytes: by its
    declared length before reading, else while reading (chunked)."""
    declared = request.headers.get("content-length")
    if declared and int(declared) > limit:
        raise InvalidArgument("body", f"must be at most {limit} bytes", f"<{declared} bytes>")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise InvalidArgument("body", f"must be at most {limit} bytes", f"<{size}+ bytes>")
        chunks.append(chunk)
    return b"".join(chunks)


async def event_stream(events: AsyncIterator[ExecEvent]) -> StreamingResponse:
    """A command's events as NDJSON. The first is awaited before the status
    is sent, so an error before the command starts (no such sandbox, a bad
    user) is a plain HTTP error; one after it is the stream's last line."""
    first = await anext(aiter(events))

    async def stream() -> AsyncIterator[bytes]:
        yield event_line(first)
        try:
            async for ev in events:
                yield event_line(ev)
        except Exception as exc:
            yield error_line(exc)

    return StreamingResponse(stream(), media_type="application/x-ndjson")


SSE_KEEPALIVE = 15.0  # seconds between comment lines on a quiet stream (proxies cut idle ones)


def sse_stream(events: AsyncIterator[Event]) -> StreamingResponse:
    """Events as Server-Sent Events: one `data:` line of JSON each, and a
    comment line when the stream has been quiet for SSE_KEEPALIVE. The
    subscription already holds (the service subscribed when called)."""

    async def stream() -> AsyncIterator[bytes]:
        it = aiter(events)
        pending: asyncio.Task[Event] | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(it))
                done, _ = await asyncio.wait({pending}, timeout=SSE_KEEPALIVE)
                if not done:
                    yield b": keepalive\n\n"
                    continue
                try:
                    event = pending.result()
                except CorralError as exc:  # its key revoked, its node lost: said, then ended
                    yield b"event: error\ndata: " + json.dumps({"error": exc.to_wire()}).encode()
                    yield b"\n\n"
                    return
                finally:
                    pending = None
                yield b"data: " + event.model_dump_json().encode() + b"\n\n"
        finally:
            if pending is not None:
                pending.cancel()
            aclose = getattr(it, "aclose", None)
            if aclose is not None:
                await aclose()

    headers = {"cache-control": "no-store", "x-accel-buffering": "no"}
    return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)


# The sandbox a path names: Corral's /v1/sandboxes/<id>, E2B's /sandboxes/<id>
# and /v2/sandboxes/<id> (api/compat/e2b). Only well-formed ids (corral.ids).
_SANDBOX_PATH = re.compile(r"/(?:v[12]/)?sandboxes/([a-z0-9]{1,16}-[0-9a-f]{16})(?:/|$)")
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable, no spaces: safe to echo
# A live view's path carries its token (api/liveview.py): never into a trace.
_VIEW_TOKEN = re.compile(r"^/view/(?!novnc/)[^/]+")


_NOSNIFF = (b"x-content-type-options", b"nosniff")


class RequestContext:
    """Per HTTP request: its id (the caller's X-Request-Id, else a new one,
    echoed back as X-Request-Id) and the sandbox its path names, in every
    log line written while it is handled (corral/log.py); with tracing on, a
    SERVER span continuing the caller's traceparent, so a create through a
    gateway is one trace across gateway and node. A plain ASGI middleware
    (not BaseHTTPMiddleware): the request runs in this very context, and a
    streamed response's task inherits it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                given = value.decode("latin-1")
                break
        rid = given if given is not None and _REQUEST_ID.fullmatch(given) else None
        rid = rid or log.new_request_id()
        raw = rid.encode()
        m = _SANDBOX_PATH.match(scope["path"])
        status = [0]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                # nosniff: an answer is what its type says (a file read as
                # octet-stream is never rendered as a page on this origin).
                headers = [*message.get("headers", ()), (b"x-request-id", raw), _NOSNIFF]
                message = {**message, "headers": headers}
            await send(message)

        token = log.bind(request_id=rid, sandbox=m.group(1) if m else None)
        try:
            if not trace.enabled():
                await self.app(scope, receive, send_with_id)
                return
            carrier = {
                k.decode("latin-1"): v.decode("latin-1")
                for k, v in scope["headers"]
                if k in (b"traceparent", b"tracestate")
            }
            method = scope["method"]
            path = _VIEW_TOKEN.sub("/view/{token}", scope["path"])
            with trace.server(
                method,
                carrier,
                **{"http.request.method": method, "url.path": path, "request.id": rid},
            ) as span:
                await self.app(scope, receive, send_with_id)
                # The route's template once routing found it: span names of
                # bounded cardinality ("POST /v1/sandboxes/{sandbox_id}/exec").
                route = getattr(scope.get("route"), "path", None)
                if route:
                    span.rename(f"{method} {route}")
                    span.set("http.route", route)
                span.set("http.response.status_code", status[0])
                if m:
                    span.set("sandbox.id", m.group(1))
        except StreamCut:
            reset = reset_of(scope)
            if not callable(reset):
                raise  # HTTP/2, a unix socket: the server ends the stream unfinished
            reset()
            # The transport's connection_lost is scheduled, not run: let it
            # run, so that uvicorn finds a client gone rather than an
            # answer left unfinished (which it would log as an error).
            await asyncio.sleep(0)
        finally:
            log.unbind(token)


# The most a request body may be before any handler sees it. FastAPI reads
# a model's whole body before validating it, and uvicorn bounds nothing: a
# client could otherwise make the server hold any size. A JSON body's
# largest honest content is a command's stdin or a function call's files
# (64 MiB each, base64); any other's a file or tar archive (MAX_BODY) in a
# multipart upload's framing. Handlers keep their own, tighter bounds.
MAX_JSON_BODY = 128 << 20
MAX_ANY_BODY = MAX_BODY + (1 << 20)


class BodyLimit:
    """Refuses a request body past its bound: by its declared length before
    a byte is read, else (chunked, HTTP/2) as it arrives."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        limit = MAX_JSON_BODY if ctype == b"application/json" else MAX_ANY_BODY
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            err = InvalidArgument(
                "body", f"must be at most {limit} bytes", f"<{int(declared)} bytes>"
            )
            await JSONResponse({"error": err.to_wire()}, err.http_status)(scope, receive, send)
            return
        received = 0

        async def bounded() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > limit:
                # FastAPI passes an HTTPException raised while it reads a
                # body on to the app's handler (any other becomes "error
                # parsing the body").
                raise HTTPException(413, f"request body must be at most {limit} bytes")
            return message

        await self.app(scope, bounded, send)


class SameOrigin:
    """Refuses a request that changes something when a browser says it
    comes from another site: a page elsewhere (or a sandbox's own web page,
    served from a sibling host) could otherwise post to a keyless local
    server, or log a victim's dashboard into another key. Programs send
    neither header and pass; so do the dashboard's own forms."""

    SAFE = (b"GET", b"HEAD", b"OPTIONS")

    def __init__(
        self,
        app: ASGIApp,
        *,
        loopback_only: bool = False,
        port_host: Callable[[str], bool] | None = None,
    ) -> None:
        self.app = app
        self.loopback_only = loopback_only
        # A Host that names a sandbox's port: E2B's ports middleware answers
        # it (with the sandbox's own token) before any of Corral's routes.
        self.port_host = port_host

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if (
            self.loopback_only
            and _rebound(scope, headers)
            and not (
                scope["type"] == "http"
                and self.port_host is not None
                and self.port_host(headers.get(b"host", b"").decode("latin-1").lower())
            )
        ):
            # A server without a key trusts whoever reaches it, which on
            # loopback is this machine's users, unless a page elsewhere
            # re-points its own name at 127.0.0.1 (DNS rebinding): its
            # requests are then "same-origin" to the browser. They name
            # that other host.
            why = "Host: " + headers.get(b"host", b"").decode("latin-1")
            said = f"a server without an API key answers loopback names only ({why})"
            await _refuse(scope, receive, send, said, why)
            return
        if scope["type"] != "http" or scope["method"].encode() in self.SAFE:
            await self.app(scope, receive, send)
            return
        why = _cross_site(headers)
        if why is None:
            await self.app(scope, receive, send)
            return
        said = f"a request from another site is refused ({why})"
        await _refuse(scope, receive, send, said, why)


async def _refuse(scope: Scope, receive: Receive, send: Send, said: str, why: str) -> None:
    err = PermissionDenied(said, reason=why)
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008, "reason": err.message[:120]})
        return
    await JSONResponse({"error": err.to_wire()}, status_code=err.http_status)(scope, receive, send)


def _rebound(scope: Scope, headers: dict[bytes, bytes]) -> bool:
    """Whether a keyless server's request names a host other than loopback
    (a unix socket's have no host to check). No header exempts it: after a
    rebinding the page is same-origin and may send any header it likes."""
    server = scope.get("server")
    if not server or server[1] is None:
        return False
    host = headers.get(b"host", b"").decode("latin-1").lower()
    name = host[1 : host.find("]")] if host.startswith("[") else host.rsplit(":", 1)[0]
    if name == "localhost" or name.endswith(".localhost"):  # RFC 6761: always loopback
        return False
    try:
        return not ipaddress.ip_address(name).is_loopback
    except ValueError:
        return True  # any other name: one a page elsewhere may have re-pointed


def _cross_site(headers: dict[bytes, bytes]) -> str | None:
    """Why the browser's headers say another site sent it, or None. Fetch
    metadata first (every current browser sends it); else the Origin
    against the host it was sent to (a proxy may rename the host: it says
    which in X-Forwarded-Host)."""
    site = headers.get(b"sec-fetch-site")
    if site is not None:
        return None if site in (b"same-origin", b"none") else f"Sec-Fetch-Site: {site.decode()}"
    origin = headers.get(b"origin")
    if origin is None:
        return None
    if origin == b"null":
        return "Origin: null"
    host = headers.get(b"x-forwarded-host") or headers.get(b"host", b"")
    if urlsplit(origin.decode("latin-1")).netloc.lower() != host.decode("latin-1").lower():
        return f"Origin: {origin.decode('latin-1')}"
    return None


class CorralApp(FastAPI):
    """FastAPI with RequestContext outermost, in front of even the error
    middleware: the log line of an unexpected error carries the request's
    id, and its 500 echoes X-Request-Id like every other answer. Inside it,
    SameOrigin refuses what another site's page sends, BodyLimit bounds
    every request's body, and AbandonedCreates closes what a create made for
    a client that left."""

    def build_middleware_stack(self) -> ASGIApp:
        # BodyLimit inside AbandonedCreates: that one reads a create's first
        # MiB itself, and the limit's refusal must be raised where the app's
        # handlers answer it (while a route reads its body).
        inner = AbandonedCreates(BodyLimit(super().build_middleware_stack()), self._resolve)
        loopback_only = bool(getattr(self.state, "loopback_only", False))
        port_host = getattr(self.state, "loopback_exempt", None)
        return RequestContext(SameOrigin(inner, loopback_only=loopback_only, port_host=port_host))

    async def _resolve(self, request: Request) -> SandboxService:
        svc: SandboxService = await self.state.resolve(request)
        return svc
