"""The HTTP API over any SandboxService (the node agent; later a gateway).

Errors travel as ``{"error": {"code", "message", ...}}`` with the HTTP status
of their code (corral/errors.py); a command's output streams back as NDJSON
events: started, stdout/stderr (base64 data), exit, or error.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from corral import __version__, metrics
from corral.api.compat import sandboxfusion
from corral.api.models import (
    AuditReport,
    CommitRequest,
    CreateSandbox,
    DisplayInput,
    ExecRequest,
    FileEntry,
    FnCallRequest,
    FnCallResult,
    ForkRequest,
    LayerInfo,
    NetworkPolicy,
    SandboxInfo,
    SavedState,
    SaveRequest,
)
from corral.api.service import SandboxService
from corral.errors import (
    CorralError,
    InternalError,
    InvalidArgument,
    NotFound,
    Unauthenticated,
)
from corral.log import get_logger

log = get_logger("corral.api")

MAX_BODY = 1 << 30


def _error_response(err: CorralError) -> JSONResponse:
    return JSONResponse({"error": err.to_wire()}, status_code=err.http_status)


def parse_labels(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidArgument("label", "must be key=value", item)
        out[key] = value
    return out


async def _body(request: Request, limit: int) -> bytes:
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


async def _service(request: Request) -> SandboxService:
    """The service this request is for (its caller's view, on a gateway)."""
    svc: SandboxService = await request.app.state.resolve(request)
    return svc


Svc = Annotated[SandboxService, Depends(_service)]


def create_app(
    service: SandboxService | None,
    api_key: str | None = None,
    *,
    for_token: Callable[[str], Awaitable[SandboxService]] | None = None,
) -> FastAPI:
    """The API over `service`, behind `api_key` if given; or, for a gateway,
    over whatever `for_token(key)` returns for the caller's key (its
    project's view), which also decides whether the key is valid."""
    app = FastAPI(
        title="Corral",
        version=__version__,
        description="Sandboxes for agent RL: containers today, one API for every backend.",
    )

    @app.exception_handler(CorralError)
    async def _corral_error(_req: Request, exc: CorralError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        loc = [str(p) for p in first["loc"] if p not in ("body", "query", "path")]
        rule = str(first["msg"]).removeprefix("Value error, ")
        if first.get("type") == "extra_forbidden":
            rule = "is not a known field"
        return _error_response(InvalidArgument(".".join(loc) or "body", rule, first.get("input")))

    @app.exception_handler(StarletteHTTPException)
    async def _routing(req: Request, exc: StarletteHTTPException) -> JSONResponse:
        # No route matched (or the method is wrong): the same wire error
        # shape as everything else, so clients never see a bare 404.
        if exc.status_code == 404:
            return _error_response(NotFound(f"no endpoint {req.method} {req.url.path}"))
        return _error_response(
            InvalidArgument("request", str(exc.detail), f"{req.method} {req.url.path}")
        )

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, exc: Exception) -> JSONResponse:
        log.error("api.unexpected", exc=True, error=str(exc))
        return _error_response(InternalError(f"internal error: {type(exc).__name__}: {exc}"))

    async def resolve(request: Request) -> SandboxService:
        header = request.headers.get("authorization", "")
        given = header.removeprefix("Bearer ").strip()
        if for_token is not None:
            return await for_token(given)
        if api_key is not None and not hmac.compare_digest(given.encode(), api_key.encode()):
            raise Unauthenticated("a valid API key is required: Authorization: Bearer <key>")
        assert service is not None
        return service

    app.state.resolve = resolve

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "version": __version__}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/sandboxes", status_code=201)
    async def create(svc: Svc, req: CreateSandbox) -> SandboxInfo:
        return await svc.create(req)

    @app.get("/v1/sandboxes")
    async def list_sandboxes(
        svc: Svc,
        label: Annotated[list[str], Query()] = [],  # noqa: B006 (FastAPI idiom)
    ) -> dict[str, list[SandboxInfo]]:
        return {"sandboxes": await svc.list(parse_labels(label) or None)}

    @app.get("/v1/sandboxes/{sandbox_id}")
    async def get(svc: Svc, sandbox_id: str) -> SandboxInfo:
        return await svc.get(sandbox_id)

    @app.delete("/v1/sandboxes/{sandbox_id}", status_code=204)
    async def close(svc: Svc, sandbox_id: str) -> Response:
        await svc.close(sandbox_id)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/exec")
    async def exec_command(svc: Svc, sandbox_id: str, req: ExecRequest) -> StreamingResponse:
        events = svc.exec(sandbox_id, req)
        # Errors before the command starts become a plain HTTP error.
        first = await anext(aiter(events))

        async def stream() -> AsyncIterator[bytes]:
            yield first.model_dump_json().encode() + b"\n"
            try:
                async for ev in events:
                    yield ev.model_dump_json().encode() + b"\n"
            except Exception as exc:
                err = exc if isinstance(exc, CorralError) else InternalError(str(exc))
                yield json.dumps({"type": "error", "error": err.to_wire()}).encode() + b"\n"

        return StreamingResponse(stream(), media_type="application/x-ndjson")

    @app.post("/v1/sandboxes/{sandbox_id}/commands/{pid}/kill", status_code=204)
    async def kill(svc: Svc, sandbox_id: str, pid: int, signal: int = 9) -> Response:
        await svc.kill(sandbox_id, pid, signal)
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/files")
    async def read_file(svc: Svc, sandbox_id: str, path: str, user: str = "root") -> Response:
        data = await svc.read_file(sandbox_id, path, user)
        return Response(data, media_type="application/octet-stream")

    @app.put("/v1/sandboxes/{sandbox_id}/files")
    async def write_file(
        svc: Svc,
        sandbox_id: str,
        path: str,
        request: Request,
        user: str = "root",
        mode: int = 0o644,
    ) -> dict[str, int]:
        data = await _body(request, MAX_BODY)
        return {"bytes": await svc.write_file(sandbox_id, path, data, user, mode)}

    @app.delete("/v1/sandboxes/{sandbox_id}/files", status_code=204)
    async def remove_file(
        svc: Svc, sandbox_id: str, path: str, user: str = "root", recursive: bool = True
    ) -> Response:
        await svc.remove_file(sandbox_id, path, user, recursive)
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/files/list")
    async def list_files(
        svc: Svc, sandbox_id: str, path: str, user: str = "root"
    ) -> dict[str, list[FileEntry]]:
        return {"entries": await svc.list_files(sandbox_id, path, user)}

    @app.get("/v1/sandboxes/{sandbox_id}/files/stat")
    async def stat_file(svc: Svc, sandbox_id: str, path: str, user: str = "root") -> FileEntry:
        return await svc.stat_file(sandbox_id, path, user)

    @app.post("/v1/sandboxes/{sandbox_id}/files/mkdir", status_code=204)
    async def make_dir(svc: Svc, sandbox_id: str, path: str, user: str = "root") -> Response:
        await svc.make_dir(sandbox_id, path, user)
        return Response(status_code=204)

    @app.put("/v1/sandboxes/{sandbox_id}/tar", status_code=204)
    async def upload_tar(svc: Svc, sandbox_id: str, path: str, request: Request) -> Response:
        await svc.upload_tar(sandbox_id, path, await _body(request, MAX_BODY))
        return Response(status_code=204)

    @app.get("/v1/sandboxes/{sandbox_id}/tar")
    async def download_tar(svc: Svc, sandbox_id: str, path: str) -> Response:
        return Response(await svc.download_tar(sandbox_id, path), media_type="application/x-tar")

    @app.put("/v1/sandboxes/{sandbox_id}/network")
    async def update_network(svc: Svc, sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo:
        return await svc.update_network(sandbox_id, policy)

    @app.post("/v1/sandboxes/{sandbox_id}/suspend")
    async def suspend(svc: Svc, sandbox_id: str) -> SandboxInfo:
        return await svc.suspend(sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/save")
    async def save(svc: Svc, sandbox_id: str, req: SaveRequest) -> SavedState:
        return await svc.save(sandbox_id, req)

    @app.post("/v1/restore")
    async def restore(svc: Svc, req: SavedState) -> SandboxInfo:
        return await svc.restore(req)

    @app.post("/v1/sandboxes/{sandbox_id}/fork")
    async def fork(svc: Svc, sandbox_id: str, req: ForkRequest) -> list[SandboxInfo]:
        return await svc.fork(sandbox_id, req)

    @app.get("/v1/sandboxes/{sandbox_id}/display/screenshot")
    async def screenshot(svc: Svc, sandbox_id: str) -> Response:
        return Response(await svc.screenshot(sandbox_id), media_type="image/png")

    @app.post("/v1/sandboxes/{sandbox_id}/display/input", status_code=204)
    async def display_input(svc: Svc, sandbox_id: str, req: DisplayInput) -> Response:
        await svc.display_input(sandbox_id, req)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/resume")
    async def resume(svc: Svc, sandbox_id: str) -> SandboxInfo:
        return await svc.resume(sandbox_id)

    @app.get("/v1/sandboxes/{sandbox_id}/audit")
    async def audit(svc: Svc, sandbox_id: str) -> AuditReport:
        return await svc.audit(sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/commit")
    async def commit(svc: Svc, sandbox_id: str, req: CommitRequest) -> LayerInfo:
        return await svc.commit(sandbox_id, req)

    @app.post("/v1/fncall")
    async def run_call(svc: Svc, req: FnCallRequest) -> FnCallResult:
        return await svc.run_call(req)

    @app.post("/run_code")
    @app.post("/v1/run_code")
    async def run_code(
        svc: Svc, req: sandboxfusion.RunCodeRequest
    ) -> sandboxfusion.RunCodeResponse:
        """SandboxFusion's endpoint (see api/compat/sandboxfusion.py)."""
        result = await svc.run_call(sandboxfusion.to_call(req))
        return sandboxfusion.from_result(result)

    return app
