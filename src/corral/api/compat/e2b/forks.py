"""E2B's fork over Corral's: `POST /sandboxes/{id}/fork` makes `count`
copies of a running sandbox, each with its memory, processes and files as
they are now; the source pauses while its state is saved and runs on, its
id and timeout untouched.

Corral's fork is all or nothing (a copy that fails to start takes the
others with it), so a failed fork is an error status and leaves no copy:
E2B's "the request failed before any fork was attempted". A 201 lists
every copy, each a sandbox. Each copy gets `timeout` (E2B's, from now)
and tokens of its own; its metadata and template are its source's. A
container is copied with CRIU, and only while no command runs in it
(their connections cannot be carried): 409 otherwise, as Corral's fork.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from corral.api.models import SandboxInfo
from corral.api.models_vm import ForkRequest
from corral.api.service import SandboxService

MAX_COPIES = 32  # Corral's fork (ForkRequest.n); E2B's own API takes up to 100


class ForkError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _count(doc: dict[str, Any]) -> int:
    n = doc.get("count", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_COPIES:
        raise ForkError(400, f"count must be a whole number from 1 to {MAX_COPIES}: {n!r}")
    return n


def router(
    resolve: Callable[[Request], Awaitable[SandboxService]],
    get_sandbox: Callable[[SandboxService, str], Awaitable[SandboxInfo]],
    body: Callable[[Request], Awaitable[dict[str, Any]]],
    timeout_of: Callable[[dict[str, Any]], int | None],
    created: Callable[[SandboxInfo], dict[str, Any]],
    error_response: Callable[[Exception], JSONResponse],
) -> APIRouter:
    """The control API's helpers: `get_sandbox` its live-sandbox lookup
    (404 otherwise), `body` and `timeout_of` its request readers,
    `created` the body a create answers with."""
    r = APIRouter()

    async def fork(request: Request, sandbox_id: str) -> Any:
        try:
            svc = await resolve(request)
            doc = await body(request)
            n, ttl = _count(doc), timeout_of(doc)
            await get_sandbox(svc, sandbox_id)
            copies = await svc.fork(sandbox_id, ForkRequest(n=n))
            try:
                if ttl:
                    copies = list(await asyncio.gather(*(svc.set_ttl(c.id, ttl) for c in copies)))
            except BaseException:
                # All or nothing, as the fork itself: no copy nobody was given.
                closes = (svc.close(c.id) for c in copies)
                await asyncio.shield(asyncio.gather(*closes, return_exceptions=True))
                raise
        except ForkError as exc:
            return JSONResponse({"code": exc.status, "message": exc.message}, exc.status)
        except Exception as exc:
            return error_response(exc)
        return JSONResponse([{"sandbox": created(c)} for c in copies], status_code=201)

    r.add_api_route("/sandboxes/{sandbox_id}/fork", fork, methods=["POST"])
    return r
