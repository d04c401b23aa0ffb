"""A sandbox's own servers, reached through Corral's envd endpoint.

E2B names a port of a sandbox by the header `E2b-Sandbox-Port` (what the
SDK sends with E2B_SANDBOX_URL; code-interpreter's 49999) or by the host
`<port>-<sandbox id>.<domain>` (Sandbox.get_host). A sandbox has no
network by default, so the request goes in through the sandbox itself: the
platform's busybox `nc` connects to 127.0.0.1:<port> inside it, the request
is written as HTTP/1.1 (Connection: close) on its stdin, and the response
read from its stdout is parsed (h11) and streamed back. One command per
request.

A port is reached with the sandbox's token (X-Access-Token, or E2B's
E2B-Traffic-Access-Token), never without: E2B's ports are public by
default, Corral's are not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import re
from collections.abc import AsyncIterator, Iterable

import h11
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from corral.api.models import ExecOutput, ExecRequest, ExecStarted
from corral.api.service import SandboxService
from corral.api.wire import KEY_COOKIES, StreamCut
from corral.host import platform as plat

ENVD_PORT = 49983
MAX_BODY = 64 << 20  # a request forwarded in one piece
REQUEST_TIMEOUT = 3600.0  # a forwarded request (a long stream) lasts at most this
_HOST = re.compile(r"^(\d{1,5})-([a-z0-9]{1,16}-[0-9a-f]{16})\.")
# Hop-by-hop, or E2B's routing: not for the sandbox's server.
_DROP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
         "upgrade", "host", "content-length", "x-access-token", "e2b-traffic-access-token",
         "e2b-sandbox-id", "e2b-sandbox-port", "server", "date"}  # fmt: skip


_CLEANUPS: set[asyncio.Future[None]] = set()  # running past their request's cancel
# The server's states once its answer is whole (we asked it to close after).
_ENDED = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED)


def target(request: Request) -> tuple[str, int] | None:
    """(sandbox id, port) when the request is for a sandbox's own server."""
    port = request.headers.get("e2b-sandbox-port")
    sid = request.headers.get("e2b-sandbox-id")
    if port and sid and port != str(ENVD_PORT):
        return sid, _port(port)
    m = _HOST.match(request.headers.get("host", ""))
    if m and int(m.group(1)) != ENVD_PORT:
        return m.group(2), _port(m.group(1))
    return None


def envd_sandbox(host: str) -> str:
    """The sandbox a Host `49983-<id>.<domain>` names ("" for another)."""
    m = _HOST.match(host)
    return m.group(2) if m and int(m.group(1)) == ENVD_PORT else ""


def names_a_port(host: str) -> bool:
    """Whether a Host is a sandbox port's (`<port>-<id>.<domain>`, not
    envd's): such a request goes to that port alone (SandboxPorts), only
    with the sandbox's own token, and never reaches Corral's routes."""
    m = _HOST.match(host)
    return m is not None and int(m.group(1)) != ENVD_PORT


def _port(raw: str) -> int:
    p = int(raw) if raw.isdigit() else 0
    return p if 1 <= p <= 65535 else 0


def token_of(request: Request) -> str:
    return request.headers.get("x-access-token") or request.headers.get(
        "e2b-traffic-access-token", ""
    )


def _ours(authorization: str, own_key: str | None) -> bool:
    """Whether an Authorization carries a Corral credential, however spaced
    or cased: a project's key, a direct token, or this server's own key."""
    value = authorization.strip()
    scheme, _, rest = value.partition(" ")
    # The resolver reads "Bearer X" and a bare "X" alike (api/app.py).
    cred = rest.strip() if scheme.lower() == "bearer" else value
    if cred.startswith(("ck_", "dt1.")):
        return True
    return bool(own_key) and hmac.compare_digest(cred.encode(), (own_key or "").encode())


def _answered(given: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The sandbox server's answer headers as the client gets them: without
    the hop's own, and nothing that would outlive the answer on Corral's own
    host (the header-routed path shares it): no HSTS, and no cookie that is
    Corral's login or set for a wider domain than the host that asked."""
    out = []
    for k, v in given:
        name = k.lower()
        if name.decode("latin-1") in _DROP or name == b"strict-transport-security":
            continue
        if name == b"set-cookie":
            cookie = v.decode("latin-1")
            first, *attrs = cookie.split(";")
            if first.split("=", 1)[0].strip() in KEY_COOKIES or any(
                a.strip().lower().startswith("domain=") for a in attrs
            ):
                continue
        out.append((name, v))
    return out


def _outgoing(
    given: Iterable[tuple[str, str]], own_key: str | None = None
) -> list[tuple[str, str]]:
    """A request's headers as the sandbox's server gets them: without the
    hop's own, and without any Corral credential a client sent along (an
    API key in X-API-Key or as a bearer, a direct token, the dashboard's
    login cookie), which would hand root in the sandbox the caller's
    project. The server's own credentials (its cookies, its bearer tokens)
    pass."""
    out = []
    for k, v in given:
        name = k.lower()
        if name in _DROP or name == "x-api-key":
            continue
        if name == "authorization" and _ours(v, own_key):
            continue
        if name == "cookie":
            kept = [c for c in v.split(";") if c.split("=", 1)[0].strip() not in KEY_COOKIES]
            if not kept:
                continue
            v = ";".join(kept).strip()
        out.append((k, v))
    return out


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


async def forward(
    svc: SandboxService, sid: str, port: int, request: Request, own_key: str | None = None
) -> Response:
    if not port:
        return _error(400, "E2b-Sandbox-Port must be a port number, 1-65535")
    held = bytearray()
    async for chunk in request.stream():  # counted as it comes: never held past the cap
        held += chunk
        if len(held) > MAX_BODY:
            return _error(413, f"a forwarded request is at most {MAX_BODY} bytes")
    body = bytes(held)
    conn = h11.Connection(h11.CLIENT)
    path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    headers = _outgoing(request.headers.items(), own_key)
    headers += [("host", f"127.0.0.1:{port}"), ("connection", "close"),
                ("content-length", str(len(body)))]  # fmt: skip
    raw = conn.send(h11.Request(method=request.method, target=path, headers=headers))
    raw = (
        (raw or b"")
        + (conn.send(h11.Data(data=body)) or b"")
        + (conn.send(h11.EndOfMessage()) or b"")
    )
    req = ExecRequest(
        cmd=[plat.BUSYBOX, "nc", "127.0.0.1", str(port)], user="root", cwd="/",
        timeout=REQUEST_TIMEOUT, stdin=raw, stdin_open=True, stdout_limit=256 << 20,
    )  # fmt: skip
    events = aiter(svc.exec(sid, req))
    head: h11.Response | None = None
    early: list[bytes] = []
    pid = 0

    async def cleanup() -> None:
        await events.aclose()  # type: ignore[attr-defined]
        if pid:  # a server that keeps the connection open: nc would wait on
            with contextlib.suppress(Exception):
                await svc.kill(sid, pid)

    async def done() -> None:
        # Also when the client went away and this task is being cancelled:
        # nc must die, so that the sandbox's server sees its client go (the
        # code interpreter then interrupts the abandoned execution).
        task = asyncio.ensure_future(cleanup())
        _CLEANUPS.add(task)
        task.add_done_callback(_CLEANUPS.discard)
        await asyncio.shield(task)

    async for ev in events:
        if isinstance(ev, ExecStarted):
            pid = ev.pid
        if isinstance(ev, ExecOutput) and ev.type == "stdout":
            conn.receive_data(ev.data)
            while True:
                got = conn.next_event()
                if got is h11.NEED_DATA or isinstance(got, h11.PAUSED):
                    break
                if isinstance(got, h11.Response):
                    head = got
                elif isinstance(got, h11.Data):
                    early.append(bytes(got.data))
                elif isinstance(got, h11.EndOfMessage | h11.ConnectionClosed):
                    break
            if head is not None:
                break
    if head is None:
        await done()
        return _error(502, f"nothing answered on port {port} of sandbox {sid}")

    async def rest() -> AsyncIterator[bytes]:
        try:
            for chunk in early:
                yield chunk
            if conn.their_state in _ENDED:
                return
            async for ev in events:
                if not (isinstance(ev, ExecOutput) and ev.type == "stdout"):
                    continue
                conn.receive_data(ev.data)
                while True:
                    got = conn.next_event()
                    if isinstance(got, h11.Data):
                        yield bytes(got.data)
                    elif got is h11.NEED_DATA or isinstance(got, h11.PAUSED):
                        break
                    else:  # the end of the body: the server closes
                        return
            # nc is done: the server closed. A body read to the close ends
            # here; any other end is the sandbox (or its server) going away
            # mid-answer, which the client must see as a cut connection, not
            # as an answer that looks whole.
            with contextlib.suppress(h11.RemoteProtocolError):
                conn.receive_data(b"")
                while isinstance(got := conn.next_event(), h11.Data):
                    yield bytes(got.data)
                if conn.their_state in _ENDED:
                    return
            raise StreamCut(f"port {port} of sandbox {sid} stopped mid-answer")
        finally:
            await done()

    response = StreamingResponse(rest(), status_code=head.status_code)
    response.raw_headers += _answered(head.headers)  # repeated ones (Set-Cookie) kept
    return response
