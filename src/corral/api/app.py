"""The HTTP API over any SandboxService (a node agent, or a gateway's view
of its caller's project).

The operations' endpoints come from the route table (api/routes.py, made
into api/endpoints.py by gen_routes); this module adds what is not an
operation: the error handlers, the caller's key, /healthz, /metrics and
SandboxFusion's /run_code. Errors travel as ``{"error": {"code",
"message", ...}}`` with the HTTP status of their code (corral/errors.py).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from corral import metrics
from corral.api import direct
from corral.api.compat import sandboxfusion
from corral.api.compat.e2b import add_e2b, ports
from corral.api.endpoints import add_routes
from corral.api.service import SandboxService
from corral.api.serving import CorralApp, Svc
from corral.api.wire import as_corral, key_cookie
from corral.errors import (
    CorralError,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)
from corral.log import get_logger
from corral.version import __version__

log = get_logger("corral.api")


def _error_response(err: CorralError) -> JSONResponse:
    return JSONResponse({"error": err.to_wire()}, status_code=err.http_status)


# E2B's control API's paths (api/compat/e2b/control.py).
_E2B_PATHS = ("/sandboxes", "/v2/", "/snapshots", "/templates")


def create_app(
    service: SandboxService | None,
    api_key: str | None = None,
    *,
    for_token: Callable[[str], Awaitable[SandboxService]] | None = None,
    for_sandbox: Callable[[str], Awaitable[SandboxService]] | None = None,
    e2b_templates: dict[str, str] | None = None,
    node: str | None = None,
    operator: Callable[[SandboxService], Awaitable[bool]] | None = None,
    loopback_only: bool = False,
) -> FastAPI:
    """The API over `service`, behind `api_key` if given; or, for a gateway,
    over whatever `for_token(key)` returns for the caller's key (its
    project's view), which also decides whether the key is valid.
    `loopback_only`: a keyless server's, answering loopback host names only."""
    # FastAPI with a request id, sandbox and trace per request (api/serving.py).
    app = CorralApp(
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
        # shape as everything else, so clients never see a bare 404. Under
        # E2B's paths that shape is E2B's ({"code", "message"}), which its
        # clients parse.
        if req.url.path.startswith(_E2B_PATHS):
            message = f"no endpoint {req.method} {req.url.path}"
            return JSONResponse({"code": exc.status_code, "message": message}, exc.status_code)
        if exc.status_code == 404:
            return _error_response(NotFound(f"no endpoint {req.method} {req.url.path}"))
        return _error_response(
            InvalidArgument("request", str(exc.detail), f"{req.method} {req.url.path}")
        )

    @app.exception_handler(Exception)
    async def _unexpected(_req: Request, exc: Exception) -> JSONResponse:
        return _error_response(as_corral(exc))

    async def resolve(request: Request) -> SandboxService:
        header = request.headers.get("authorization", "")
        # E2B's SDK sends its key as X-API-KEY (api/compat/e2b).
        given = header.removeprefix("Bearer ").strip() or request.headers.get("x-api-key", "")
        if not given and request.method in ("GET", "HEAD"):
            # The dashboard's login cookie (corral/dashboard/auth.py), for
            # reads only: a cross-site POST can never ride on it.
            given = key_cookie(request.cookies)
        if for_token is not None:
            return await for_token(given)
        if node is not None and api_key is not None and direct.is_token(given):
            # A gateway's direct token (api/direct.py): this node's own
            # check, for one sandbox, under that sandbox's paths only.
            sid = direct.verify(api_key, given, node)
            path = request.url.path
            if path != f"/v1/sandboxes/{sid}" and not path.startswith(f"/v1/sandboxes/{sid}/"):
                raise Unauthenticated(f"the direct token is for sandbox {sid}'s paths only")
            assert service is not None
            return direct.DirectService(service, sid).as_service()
        if api_key is not None and not hmac.compare_digest(given.encode(), api_key.encode()):
            raise Unauthenticated("a valid API key is required: Authorization: Bearer <key>")
        assert service is not None
        return service

    app.state.resolve = resolve
    # A keyless server (loopback only): requests naming another host are a
    # rebound page's (api/serving.py SameOrigin).
    app.state.loopback_only = loopback_only
    app.state.loopback_exempt = ports.names_a_port

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "version": __version__}

    @app.get("/metrics")
    async def prometheus(request: Request) -> Response:
        # Behind the same key as the API: counts of sandboxes, nodes and
        # refusals are the operator's, not anyone's who can reach the port;
        # on a gateway, the operator's alone (`operator`), not every tenant's.
        svc = await resolve(request)
        if operator is not None and not await operator(svc):
            raise PermissionDenied(
                "the gateway's metrics are its operator's (an operator project's key)"
            )
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    add_routes(app)

    async def sandbox_service(sandbox_id: str) -> SandboxService:
        # envd calls carry a sandbox's token, not a key: the service that
        # holds the sandbox (a gateway finds its project's view).
        if for_sandbox is not None:
            return await for_sandbox(sandbox_id)
        assert service is not None
        return service

    local = service if for_sandbox is None else None
    app.state.e2b = add_e2b(app, resolve, sandbox_service, e2b_templates or {}, api_key, local)

    @app.get("/v1/ping")
    async def ping() -> str:
        """SandboxFusion's liveness check (its clients wait on it)."""
        return "pong"

    @app.post("/run_code")
    @app.post("/v1/run_code")
    async def run_code(
        svc: Svc, req: sandboxfusion.RunCodeRequest
    ) -> sandboxfusion.RunCodeResponse:
        """SandboxFusion's endpoint (see api/compat/sandboxfusion.py)."""
        call = sandboxfusion.to_call(req)  # bad input: a 400 naming the field
        try:
            result = await svc.run_call(call)
        except CorralError as exc:
            if exc.http_status < 500:
                raise
            # The platform failed, not the code: SandboxFusion's SandboxError.
            return sandboxfusion.RunCodeResponse(status="SandboxError", message=str(exc))
        return sandboxfusion.from_result(result)

    @app.post("/run_jupyter")
    @app.post("/v1/run_jupyter")
    async def run_jupyter(
        svc: Svc, req: sandboxfusion.RunJupyterRequest
    ) -> sandboxfusion.RunJupyterResponse:
        """SandboxFusion's Jupyter endpoint: the cells on a warm kernel."""
        call = sandboxfusion.to_jupyter_call(req)
        try:
            result = await svc.run_call(call)
        except CorralError as exc:
            if exc.http_status < 500:
                raise
            return sandboxfusion.RunJupyterResponse(status="SandboxError", message=str(exc))
        return sandboxfusion.from_jupyter_result(result)

    return app
