"""E2B compatibility: the stock `e2b` SDKs, unmodified, against Corral
(docs/e2b.md). control.py is E2B's control API, envd.py its in-sandbox API,
both over a SandboxService."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from corral.api.compat.e2b import control, ports
from corral.api.compat.e2b.envd import Envd, ForSandbox
from corral.api.service import SandboxService


def add_e2b(
    app: FastAPI,
    resolve: control.Resolve,
    for_sandbox: ForSandbox,
    templates: dict[str, str],
    own_key: str | None = None,
    local: SandboxService | None = None,
) -> Envd:
    """Serve E2B's routes on `app`: the control API for callers `resolve`
    lets in, envd for the sandbox `for_sandbox` finds (its token checked);
    `local` is the service holding them all, where this server is a node."""
    envd = Envd(for_sandbox, local)
    app.include_router(control.router(resolve, templates, envd.forget))
    app.include_router(envd.router())

    app.add_middleware(SandboxPorts, envd=envd, own_key=own_key)
    return envd


class SandboxPorts:
    """A request for a sandbox's own server (by E2b-Sandbox-Port or by host)
    goes there, whatever its path, before routing; any other passes through
    untouched (plain ASGI: nothing added to Corral's own calls)."""

    def __init__(self, app: ASGIApp, envd: Envd, own_key: str | None = None) -> None:
        self.app = app
        self.envd = envd
        self.own_key = own_key  # this server's API key: never passed to a sandbox

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not _maybe_port(scope):
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        found = ports.target(request)
        if found is None:
            await self.app(scope, receive, send)
            return
        sandbox_id, port = found
        response: Any
        try:
            svc = await self.envd.checked(sandbox_id, ports.token_of(request), port=True)
        except Exception as exc:
            response = Envd.http_error(exc)
        else:
            response = await ports.forward(svc, sandbox_id, port, request, self.own_key)
        await response(scope, receive, send)


def _maybe_port(scope: Scope) -> bool:
    for k, v in scope.get("headers", ()):
        if k == b"e2b-sandbox-port" and v != b"49983":
            return True
        if k == b"host" and v[:1].isdigit() and b"-" in v:
            return True
    return False
