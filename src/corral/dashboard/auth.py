"""The dashboard's login: the API's key, carried by a cookie for reads.

A browser cannot send an Authorization header on a page load, so the key
posted to /ui/login is set as `corral_key` (HttpOnly: no script reads it;
SameSite=Strict: no other site's page sends it). The API's resolver
(api/app.py) accepts that cookie on GET and HEAD only, so a request that
changes anything still needs the key in a header: a forged cross-site
POST carries nothing that authenticates it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request

from corral.api.service import SandboxService
from corral.api.wire import KEY_COOKIE
from corral.errors import Unauthenticated

COOKIE = KEY_COOKIE

Resolve = Callable[[Request], Awaitable[SandboxService]]


async def caller(resolve: Resolve, request: Request) -> SandboxService | None:
    """The caller's service, or None where its key (header or cookie) is
    missing or wrong."""
    try:
        return await resolve(request)
    except Unauthenticated:
        return None


async def key_is_valid(resolve: Resolve, request: Request, key: str) -> bool:
    """Ask the API's own resolver about `key`, as if it came in a header:
    the dashboard has no key check of its own to drift from the API's."""
    if not key:
        return False
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/ui",
        "headers": [(b"authorization", f"Bearer {key}".encode())],
        "query_string": b"",
        "app": request.scope.get("app"),
    }
    return await caller(resolve, Request(scope)) is not None


def safe_next(path: str) -> str:
    """Only back into the dashboard: never an open redirect elsewhere."""
    if path.startswith("/ui") and not path.startswith("//") and "\\" not in path:
        return path
    return "/ui"
