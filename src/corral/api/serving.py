"""The server side of the HTTP API beyond the route table: how an endpoint
finds the service it runs on, reads a raw body under a cap, and streams a
command's events. The generated endpoints (api/endpoints.py) use these.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.responses import StreamingResponse

from corral.api.models import ExecEvent
from corral.api.service import SandboxService
from corral.api.wire import error_line, event_line
from corral.errors import InvalidArgument


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
