"""E2B's in-sandbox API (envd), served by Corral for every sandbox behind
one endpoint (point E2B_SANDBOX_URL at it).

A request names its sandbox in `E2b-Sandbox-Id` (or by its host,
`49983-<id>.<domain>`) and carries the envd access token the create
returned (`X-Access-Token`); the token is the sandbox's own (a label only
its project sees), so holding one sandbox's token reaches no other. A
signed file URL carries a signature made with the token instead
(signed.py). `E2b-Sandbox-Port` 49983 is envd itself; other
ports are the sandbox's own servers (ports.py).

envdVersion is 0.6.4 (control.py): the gates the SDK opens up to it are
implemented here: stdin that can be closed, octet-stream and gzip uploads,
file metadata (the file's user.e2b.* extended attributes, as envd keeps
them), entries in watch events, and `allowNetworkMounts` (a sandbox has
no network mount to refuse). PTYs are terminals corral-init opens
(ExecRequest.pty); Update resizes them.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import gzip
import hmac
import posixpath
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from starlette.types import Message

from corral.api.compat.e2b import connect as c
from corral.api.compat.e2b import ports, signed
from corral.api.compat.e2b.control import TOKEN, TRAFFIC
from corral.api.compat.e2b.filesystem import METADATA, Filesystem, ensure_dirs, resolve
from corral.api.compat.e2b.process import Processes, decode_input, pty_size, signal_of
from corral.api.models import SandboxInfo, XattrRequest
from corral.api.service import SandboxService
from corral.errors import (
    CorralError,
    FileNotFound,
    InvalidArgument,
    NotFound,
    SandboxClosed,
    SandboxLost,
)

DEFAULT_USER = "user"
MAX_UPLOAD = 256 << 20

ForSandbox = Callable[[str], Awaitable[SandboxService]]


def _gunzip(body: bytes, too_big: Exception) -> bytes:
    """A gzip body, inflated to at most MAX_UPLOAD bytes: a few MB of
    zeros inflate to hundreds of GB."""
    inflate = zlib.decompressobj(wbits=31)  # gzip's header and trailer
    try:
        out = inflate.decompress(body, MAX_UPLOAD + 1)
    except zlib.error as exc:
        raise c.ConnectError("invalid_argument", f"body is not gzip: {exc}") from None
    if len(out) > MAX_UPLOAD:
        raise too_big
    if not inflate.eof:
        raise c.ConnectError("invalid_argument", "body is not gzip: it ends early")
    return out


def _home(user: str) -> str:
    return "/root" if user == "root" else f"/home/{user}"


def _user(request: Request) -> str:
    """The user a call runs as: Basic auth's name, or envd's default."""
    header = request.headers.get("authorization", "")
    if header.lower().startswith("basic "):
        try:
            name = base64.b64decode(header[6:].strip()).decode().split(":", 1)[0]
        except (binascii.Error, UnicodeDecodeError):
            raise c.ConnectError("invalid_argument", "Authorization: malformed Basic") from None
        if name:
            return name
    return request.query_params.get("username") or DEFAULT_USER


# How long a checked token is trusted without asking again: a command's
# round trip would otherwise pay a record read. A closed sandbox still fails
# at once (the call itself finds it closed); `forget` drops it on a kill.
TOKEN_TTL = 2.0
SIGNERS_TTL = 1.0  # how long a node's list of E2B sandboxes serves signed URLs


class Envd:
    def __init__(self, for_sandbox: ForSandbox, local: SandboxService | None = None) -> None:
        self.for_sandbox = for_sandbox
        # The service holding every sandbox this server reaches (a node's,
        # not a gateway's): where a signed URL naming none finds its own.
        self.local = local
        self._listed: tuple[float, list[SandboxInfo]] = (-SIGNERS_TTL, [])  # (begun, list)
        self._listing = asyncio.Lock()
        self.processes = Processes()
        self.fs = Filesystem()
        self._checked: dict[tuple[str, str, bool], float] = {}

    def forget(self, sandbox_id: str) -> None:
        self._checked = {k: t for k, t in self._checked.items() if k[0] != sandbox_id}
        self.processes.abort(sandbox_id)
        self.fs.names.forget(sandbox_id)

    async def sandbox(self, request: Request, op: str = "") -> tuple[SandboxService, str]:
        """The caller's sandbox, once its token checks out; for `op` (a
        file's read or write), a signed URL's signature instead."""
        sandbox_id = request.headers.get("e2b-sandbox-id", "") or ports.envd_sandbox(
            request.headers.get("host", "")
        )
        given = request.headers.get("x-access-token", "")
        if op and _signed_url(request):
            return await self._signed(request, op, sandbox_id)
        if not sandbox_id:
            raise c.ConnectError("invalid_argument", "E2b-Sandbox-Id header is required")
        return await self.checked(sandbox_id, given), sandbox_id

    async def _signed(
        self, request: Request, op: str, sandbox_id: str
    ) -> tuple[SandboxService, str]:
        """The sandbox whose token signed this URL (signed.py)."""
        if "authorization" in request.headers:
            # A call's user is Basic auth's name before the query's (_user);
            # the signature covers the query's alone.
            raise c.ConnectError(
                "unauthenticated", "a signed URL acts as the user it names: no Authorization"
            )
        signed.check_form(request.query_params)
        if sandbox_id:
            try:
                svc = await self.for_sandbox(sandbox_id)
                found = [await svc.get(sandbox_id)]
            except (NotFound, InvalidArgument, SandboxLost, SandboxClosed):
                raise c.ConnectError("unauthenticated", signed.INVALID) from None
            info = signed.signer(request.query_params, op, found, TOKEN)
        elif self.local is not None:
            svc = self.local
            info = await self._signer(svc, request.query_params, op)
        else:
            raise c.ConnectError(
                "unauthenticated",
                "a signed URL through a gateway names its sandbox by host (49983-<id>.<domain>)",
            )
        if info.state.value in ("closed", "failed", "closing"):
            raise SandboxClosed(f"sandbox {info.id} is {info.state.value}", sandbox=info.id)
        return svc, info.id

    async def _signer(self, svc: SandboxService, query: Any, op: str) -> SandboxInfo:
        """The node's E2B sandbox that signed `query`. Its sandboxes are
        listed once for many URLs: a URL that none on the list signed is
        tried again on a list begun after it arrived (which holds every
        sandbox made before it), one listing at a time, shared by every
        URL waiting on it: signatures that match nothing cost no more."""
        arrived = time.monotonic()
        at, found = self._listed
        if arrived - at <= SIGNERS_TTL:
            try:
                return signed.signer(query, op, found, TOKEN)
            except c.ConnectError as exc:
                if exc.message != signed.INVALID:
                    raise
        async with self._listing:
            at, found = self._listed
            if at < arrived:
                begun = time.monotonic()
                found = [i for i in await svc.list() if TOKEN in i.labels]
                self._listed = (begun, found)
        return signed.signer(query, op, found, TOKEN)

    async def checked(self, sandbox_id: str, given: str, *, port: bool = False) -> SandboxService:
        """The service of `sandbox_id`, if `given` is its envd token (or, for
        a request to one of its ports, its traffic token). Whoever does not
        hold a token of it learns nothing of it: a sandbox that does not
        exist, another project's, a lost one, a wrong token all answer the
        same (checked before anything about the sandbox is said)."""
        refused = c.ConnectError("unauthenticated", "X-Access-Token is not this sandbox's")
        try:
            # On a gateway, finding the sandbox's project is the first thing
            # that could say it exists: inside the one answer too.
            svc = await self.for_sandbox(sandbox_id)
        except (NotFound, InvalidArgument):
            raise refused from None
        now = time.monotonic()
        if now - self._checked.get((sandbox_id, given, port), -TOKEN_TTL) < TOKEN_TTL:
            return svc
        try:
            info = await svc.get(sandbox_id)
        except (NotFound, InvalidArgument, SandboxLost, SandboxClosed):
            raise refused from None  # (an outage, Unavailable, says nothing of it: raised)
        tokens = [info.labels.get(TOKEN), *([info.labels.get(TRAFFIC)] if port else [])]
        if not any(t and hmac.compare_digest(given.encode(), t.encode()) for t in tokens):
            raise refused
        if info.state.value in ("closed", "failed", "closing"):
            raise SandboxClosed(f"sandbox {sandbox_id} is {info.state.value}", sandbox=sandbox_id)
        if len(self._checked) > 65536:
            self._checked.clear()
        self._checked[(sandbox_id, given, port)] = now
        return svc

    def router(self) -> APIRouter:
        r = APIRouter()
        r.add_api_route("/health", self.health, methods=["GET"])
        r.add_api_route("/files", self.download, methods=["GET"])
        r.add_api_route("/files", self.upload, methods=["POST"])
        r.add_api_route("/process.Process/{method}", self.process, methods=["POST"])
        r.add_api_route("/filesystem.Filesystem/{method}", self.filesystem, methods=["POST"])
        return r

    # ------------------------------------------------------------ HTTP

    async def health(self, request: Request) -> Response:
        try:
            svc, sid = await self.sandbox(request)
            info = await svc.get(sid)
        except Exception:
            return Response(status_code=502)  # the SDK's is_running() reads 502 as gone
        return Response(status_code=204 if info.state.value == "running" else 502)

    @staticmethod
    def http_error(exc: Exception) -> JSONResponse:
        err = c.from_corral(exc)
        status = c.HTTP_STATUS.get(err.code, 500)
        if isinstance(exc, SandboxClosed):
            status = 502
        return JSONResponse({"code": status, "message": err.message}, status_code=status)

    async def download(self, request: Request) -> Response:
        try:
            svc, sid = await self.sandbox(request, "read")
            user = _user(request)
            path = resolve(request.query_params.get("path"), _home(user))
            data = await svc.read_file(sid, path, user)
        except Exception as exc:
            return self.http_error(exc)
        if "gzip" in request.headers.get("accept-encoding", "") and len(data) > 256:
            return Response(
                gzip.compress(data, 1),
                media_type="application/octet-stream",
                headers={"Content-Encoding": "gzip"},
            )
        return Response(data, media_type="application/octet-stream")

    async def upload(self, request: Request) -> Response:
        try:
            svc, sid = await self.sandbox(request, "write")
            user = _user(request)
            home = _home(user)
            files = await self._uploaded(request, home)
            meta = {
                k.lower().removeprefix("x-metadata-"): v
                for k, v in request.headers.items() if k.lower().startswith("x-metadata-")
            }  # fmt: skip
            written = []
            for path, data in files:
                await ensure_dirs(svc, sid, posixpath.dirname(path), user)
                await svc.write_file(sid, path, data, user)
                # envd: a write sets the file's metadata, and drops any it had.
                values = {f"{METADATA}{k}": v for k, v in meta.items()}
                await svc.set_xattrs(
                    sid, XattrRequest(path=path, user=user, clear=METADATA, values=values)
                )
                item = {"name": path.rsplit("/", 1)[-1], "type": "file", "path": path}
                written.append({**item, "metadata": meta} if meta else item)
        except Exception as exc:
            return self.http_error(exc)
        return JSONResponse(written)

    async def _uploaded(self, request: Request, home: str) -> list[tuple[str, bytes]]:
        too_big = c.ConnectError("resource_exhausted", f"uploads are at most {MAX_UPLOAD} bytes")
        declared = request.headers.get("content-length")
        if declared and int(declared) > MAX_UPLOAD:
            raise too_big
        # Counted as received, whatever the headers said (a chunked or
        # HTTP/2 body declares no length): Starlette bounds a form's text
        # fields, not its files, which it spools to disk unbounded.
        received = 0
        inner = request.receive

        async def counted() -> Message:
            nonlocal received
            message = await inner()
            received += len(message.get("body", b""))
            if received > MAX_UPLOAD:
                raise too_big
            return message

        request = Request(request.scope, counted)
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        param = request.query_params.get("path")
        if _signed_url(request) and not param:
            # Its signature is for one path: a part's own filename is not it.
            raise c.ConnectError("invalid_argument", "a signed upload URL names its path")
        if ctype == "multipart/form-data":
            async with request.form(max_part_size=MAX_UPLOAD) as form:
                out = []
                if _signed_url(request) and len(form.getlist("file")) != 1:
                    raise c.ConnectError(
                        "invalid_argument", "a signed upload URL writes one file: one 'file' part"
                    )
                for item in form.getlist("file"):
                    if isinstance(item, str):
                        raise c.ConnectError("invalid_argument", "field 'file' must be a file part")
                    name = param if param and len(form.getlist("file")) == 1 else item.filename
                    out.append((resolve(name, home), await item.read()))
            if not out:
                raise c.ConnectError("invalid_argument", "multipart upload without a 'file' part")
            return out
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
        if request.headers.get("content-encoding", "").lower() == "gzip":
            return [(resolve(param, home), _gunzip(bytes(body), too_big))]
        return [(resolve(param, home), bytes(body))]

    # ------------------------------------------------------------ Connect RPC

    async def process(self, request: Request, method: str) -> Response:
        streaming = method in ("Start", "Connect")
        try:
            svc, sid = await self.sandbox(request)
            msg = await c.read_request(request)
            user = _user(request)
            procs = self.processes
            keepalive = _keepalive(request)
            if method == "Start":
                proc, queue = await procs.start(
                    svc, sid, msg, user=user, home=_home(user), deadline=c.timeout_s(request)
                )
                return c.stream_response(procs.stream(proc, queue, keepalive), request)
            if method == "Connect":
                proc = procs.find(sid, msg.get("process") or {})
                stream = procs.stream(proc, procs.attach(proc), keepalive)
                return c.stream_response(stream, request)
            if method == "List":
                return JSONResponse({"processes": procs.listed(sid)})
            if method == "SendSignal":
                proc = procs.find(sid, msg.get("process") or {})
                await svc.kill(sid, proc.pid, signal_of(msg.get("signal")))
                return JSONResponse({})
            if method == "SendInput":
                proc = procs.find(sid, msg.get("process") or {})
                await svc.send_stdin(sid, proc.pid, decode_input(msg))
                return JSONResponse({})
            if method == "Update":
                proc = procs.find(sid, msg.get("process") or {})
                rows, cols = pty_size(msg)
                await svc.resize_pty(sid, proc.pid, rows, cols)
                return JSONResponse({})
            if method == "CloseStdin":
                proc = procs.find(sid, msg.get("process") or {})
                await svc.send_stdin(sid, proc.pid, b"", eof=True)
                return JSONResponse({})
            raise c.ConnectError("unimplemented", f"process.Process/{method} is not implemented")
        except Exception as exc:
            return c.stream_error(exc) if streaming else c.unary_error(exc)

    async def filesystem(self, request: Request, method: str) -> Response:
        streaming = method == "WatchDir"
        try:
            svc, sid = await self.sandbox(request)
            msg = await c.read_request(request)
            user = _user(request)
            home = _home(user)
            fs = self.fs
            if method == "Stat":
                return JSONResponse(
                    {"entry": await fs.stat(svc, sid, resolve(msg.get("path"), home), user)}
                )
            if method == "ListDir":
                depth = int(msg.get("depth") or 1)
                path = resolve(msg.get("path"), home)
                return JSONResponse({"entries": await fs.list_dir(svc, sid, path, depth, user)})
            if method == "MakeDir":
                entry = await fs.make_dir(svc, sid, resolve(msg.get("path"), home), user)
                return JSONResponse({"entry": entry})
            if method == "Move":
                src, dst = resolve(msg.get("source"), home), resolve(msg.get("destination"), home)
                return JSONResponse({"entry": await fs.move(svc, sid, src, dst, user)})
            if method == "Remove":
                path = resolve(msg.get("path"), home)
                try:
                    await svc.remove_file(sid, path, user)
                except FileNotFound:
                    pass  # envd: removing what is not there succeeds
                return JSONResponse({})
            if method in ("CreateWatcher", "WatchDir"):
                w = fs.create_watcher(svc, sid, resolve(msg.get("path"), home),
                                      bool(msg.get("recursive")), user,
                                      bool(msg.get("includeEntry")))  # fmt: skip
                try:
                    await w.start()
                except BaseException:
                    fs.watchers.pop(w.id, None)
                    raise
                if method == "CreateWatcher":
                    return JSONResponse({"watcherId": w.id})

                async def watched() -> Any:
                    try:
                        async for m in w.stream(_keepalive(request)):
                            yield m
                    finally:
                        fs.watchers.pop(w.id, None)
                        await w.close()

                return c.stream_response(watched())
            if method == "GetWatcherEvents":
                events = await fs.watcher(sid, msg.get("watcherId")).events()
                return JSONResponse({"events": events})
            if method == "RemoveWatcher":
                await fs.remove_watcher(sid, msg.get("watcherId"))
                return JSONResponse({})
            raise c.ConnectError(
                "unimplemented", f"filesystem.Filesystem/{method} is not implemented"
            )
        except FileNotFound as exc:
            err = c.ConnectError("not_found", exc.message)
            return c.stream_error(err) if streaming else c.unary_error(err)
        except (CorralError, c.ConnectError, ValueError) as exc:
            return c.stream_error(exc) if streaming else c.unary_error(exc)


def _signed_url(request: Request) -> bool:
    """A signed file URL's request (signed.py): a signature and no token."""
    return "signature" in request.query_params and not request.headers.get("x-access-token")


def _keepalive(request: Request) -> float | None:
    raw = request.headers.get("keepalive-ping-interval")
    try:
        return float(raw) if raw else None
    except ValueError:
        return None
