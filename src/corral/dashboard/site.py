"""The dashboard's routes on the API's app (`corral serve`, a gateway)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from corral.api.wire import KEY_COOKIE_SECURE, KEY_COOKIES
from corral.control.core import GatewayCore
from corral.dashboard import nodes, sandboxes
from corral.dashboard.auth import COOKIE, Resolve, caller, key_is_valid, safe_next
from corral.dashboard.metrics_ring import Ring, metrics_page
from corral.dashboard.render import Safe, esc, login_page, page
from corral.dashboard.scope import Scope, scope_of
from corral.dashboard.scripts import PAGE_HEADERS
from corral.errors import CorralError, SandboxNotFound
from corral.node.agent import NodeAgent

Page = Callable[[Scope, Request], Awaitable[tuple[str, Safe]]]


def add_dashboard(
    app: FastAPI,
    resolve: Resolve,
    *,
    agent: NodeAgent | None = None,
    gateway: GatewayCore | None = None,
) -> Ring:
    """Serve the pages under /ui behind `resolve` (create_app's key check).
    `agent`: the node of `corral serve`; `gateway`: a gateway's shared
    state. Returns the metrics ring (its sampler starts with the first page)."""
    ring = Ring()

    async def serve(request: Request, active: str, render: Page) -> Response:
        svc = await caller(resolve, request)
        if svc is None:
            # A page link without (or with a stale) key: the form, not a
            # JSON error; 401 so that scripts and tests see the refusal.
            wanted = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            bad = "that key was refused" if _has_cookie(request) else ""
            return _page(login_page(safe_next(wanted), bad), status_code=401)
        ring.ensure_started()
        scope = await scope_of(svc, agent, gateway, keyed=_has_cookie(request))
        try:
            title, body = await render(scope, request)
        except SandboxNotFound as exc:
            return _page(page("Not found", Safe(f"<p>{esc(str(exc))}</p>")), 404)
        except CorralError as exc:
            body = Safe(f"<p class='bad'>{esc(str(exc))}</p>")
            return _page(page("Error", body, active=active), exc.http_status)
        return _page(page(title, body, active=active, logout=scope.keyed))

    async def list_view(scope: Scope, request: Request) -> tuple[str, Safe]:
        f = sandboxes.Filter.parse(request.query_params)
        return "Sandboxes", await sandboxes.list_page(scope, f)

    async def detail_view(scope: Scope, request: Request) -> tuple[str, Safe]:
        info = await scope.svc.get(request.path_params["sandbox_id"])
        return f"Sandbox {info.id}", await sandboxes.detail_page(scope, info)

    async def nodes_view(scope: Scope, _request: Request) -> tuple[str, Safe]:
        return "Nodes", await nodes.nodes_page(scope)

    async def projects_view(scope: Scope, _request: Request) -> tuple[str, Safe]:
        return "Projects", await nodes.projects_page(scope)

    async def metrics_view(scope: Scope, _request: Request) -> tuple[str, Safe]:
        if not scope.operator:  # a gateway's tenant: the counts are every project's
            return "Metrics", Safe(
                "<p id='metrics'>The gateway's metrics are shown to an operator.</p>"
            )
        return "Metrics", metrics_page(ring)

    @app.get("/ui", include_in_schema=False)
    @app.get("/ui/", include_in_schema=False)
    async def ui_list(request: Request) -> Response:
        return await serve(request, "sandboxes", list_view)

    @app.get("/ui/sandboxes/{sandbox_id}", include_in_schema=False)
    async def ui_detail(request: Request, sandbox_id: str) -> Response:
        return await serve(request, "sandboxes", detail_view)

    @app.get("/ui/nodes", include_in_schema=False)
    async def ui_nodes(request: Request) -> Response:
        return await serve(request, "nodes", nodes_view)

    @app.get("/ui/projects", include_in_schema=False)
    async def ui_projects(request: Request) -> Response:
        return await serve(request, "projects", projects_view)

    @app.get("/ui/metrics", include_in_schema=False)
    async def ui_metrics(request: Request) -> Response:
        return await serve(request, "metrics", metrics_view)

    @app.post("/ui/login", include_in_schema=False)
    async def ui_login(request: Request) -> Response:
        form = await request.form()
        key, wanted = str(form.get("key", "")), safe_next(str(form.get("next", "/ui")))
        if not await key_is_valid(resolve, request, key):
            return _page(login_page(wanted, "that key was refused"), status_code=401)
        out = RedirectResponse(quote(wanted, safe="/?=&%"), status_code=303)
        # Behind a TLS proxy the hop here is plain HTTP; the proxy says so (a
        # client claiming it only makes the cookie stricter).
        secure = (
            request.url.scheme == "https"
            or request.headers.get("x-forwarded-proto", "").lower() == "https"
        )
        out.set_cookie(
            KEY_COOKIE_SECURE if secure else COOKIE,
            key,
            httponly=True,
            samesite="strict",
            secure=secure,
            path="/",
        )
        return out

    @app.post("/ui/logout", include_in_schema=False)
    async def ui_logout() -> Response:
        out = RedirectResponse("/ui", status_code=303)
        for name in KEY_COOKIES:
            out.delete_cookie(
                name, path="/", httponly=True, samesite="strict", secure=name == KEY_COOKIE_SECURE
            )
        return out

    app.state.dashboard = ring
    return ring


def _has_cookie(request: Request) -> bool:
    return any(n in request.cookies for n in KEY_COOKIES)


def _page(content: str, status_code: int = 200) -> HTMLResponse:
    """A page with the headers that make a missed escape harmless: only
    the dashboard's own scripts and style run (by hash), it is framed
    nowhere (clickjacking), and nothing is sniffed or kept in a cache."""
    return HTMLResponse(content, status_code, headers=PAGE_HEADERS)
