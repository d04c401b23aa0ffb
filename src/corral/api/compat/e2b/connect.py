"""The Connect protocol as E2B's envd speaks it: JSON codec only.

Unary: `POST /<package.Service>/<Method>` with `application/json`; the reply
is the JSON message, or a non-2xx status with `{"code", "message"}`.
Server streams: `application/connect+json`, one request envelope in, and out
a sequence of envelopes `[flags u8][length u32 BE][json]` ending with an
end-of-stream envelope (flags 0x02) that carries `{}` or `{"error": ...}`;
the HTTP status of a stream is 200 even when it fails. (connectrpc.com/docs
/protocol; the e2b SDK's bundled client and its connectrpc one both speak
this.)
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from corral.api.wire import StreamCut, as_corral
from corral.errors import (
    Ambiguous,
    CommandNotFound,
    CommandTimeout,
    Conflict,
    CorralError,
    FileNotFound,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SandboxClosed,
    SandboxLost,
    Unauthenticated,
    Unavailable,
)

STREAM_TYPE = "application/connect+json"
END_STREAM = 0x02
MAX_MESSAGE = 16 << 20  # a request envelope (a file is never sent this way)

# Connect's codes and the HTTP status of each for unary replies.
HTTP_STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504,
    "not_found": 404, "already_exists": 409, "permission_denied": 403,
    "resource_exhausted": 429, "failed_precondition": 400, "aborted": 409,
    "out_of_range": 400, "unimplemented": 501, "internal": 500, "unavailable": 503,
    "data_loss": 500, "unauthenticated": 401,
}  # fmt: skip


class ConnectError(Exception):
    """An error with a Connect code, as envd would answer it."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    def body(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


class Abort(StreamCut):
    """Drop the stream's connection instead of ending it: what an envd
    client sees when its sandbox is killed under it (no end event)."""


def from_corral(exc: Exception) -> ConnectError:
    """The Connect code a Corral error is to an envd client."""
    if isinstance(exc, ConnectError):
        return exc
    exc = as_corral(exc)
    message = exc.message
    code = "internal"
    if isinstance(exc, FileNotFound | CommandNotFound | NotFound):
        code = "not_found"
    elif isinstance(exc, InvalidArgument):
        code = "invalid_argument"
    elif isinstance(exc, Unauthenticated):
        code = "unauthenticated"
    elif isinstance(exc, PermissionDenied):
        code = "permission_denied"
    elif isinstance(exc, CommandTimeout):
        code = "deadline_exceeded"
    elif isinstance(exc, ResourceExhausted):
        code = "resource_exhausted"
    elif isinstance(exc, SandboxClosed | SandboxLost | Unavailable):
        code = "unavailable"
    elif isinstance(exc, Ambiguous | Conflict):
        code = "failed_precondition"
    elif isinstance(exc, CorralError) and exc.details.get("errno") is not None:
        code = _ERRNO_CODES.get(str(exc.details.get("strerror")), "unknown")
    return ConnectError(code, message)


# A file operation's errno (FileError) as envd reports it.
_ERRNO_CODES = {
    "ENOENT": "not_found", "EEXIST": "already_exists", "EACCES": "permission_denied",
    "EPERM": "permission_denied", "ENOTDIR": "invalid_argument", "EISDIR": "invalid_argument",
    "ENOTEMPTY": "failed_precondition", "ENOSPC": "resource_exhausted",
    "EDQUOT": "resource_exhausted", "EINVAL": "invalid_argument", "ELOOP": "invalid_argument",
}  # fmt: skip


def unary_error(exc: Exception) -> JSONResponse:
    err = from_corral(exc)
    return JSONResponse(err.body(), status_code=HTTP_STATUS.get(err.code, 500))


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def end_stream(error: Exception | None = None) -> bytes:
    return envelope({} if error is None else {"error": from_corral(error).body()}, END_STREAM)


async def read_request(request: Request) -> dict[str, Any]:
    """The request message of a unary call or a server stream."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    held = bytearray()
    async for chunk in request.stream():  # counted as it comes: never held past the cap
        held += chunk
        if len(held) > MAX_MESSAGE + 5:  # + a stream envelope's head
            raise ConnectError("resource_exhausted", f"request larger than {MAX_MESSAGE} bytes")
    body = bytes(held)
    if ctype == STREAM_TYPE:
        if len(body) < 5:
            raise ConnectError("invalid_argument", "a stream request needs one envelope")
        flags, length = struct.unpack(">BI", body[:5])
        if flags & 0x01:
            raise ConnectError("unimplemented", "compressed envelopes are not supported")
        if length != len(body) - 5:
            raise ConnectError(
                "invalid_argument", f"envelope says {length} bytes, {len(body) - 5} came"
            )
        body = body[5:]
    elif ctype not in ("application/json", ""):
        raise ConnectError(
            "unimplemented", f"content type {ctype!r}: this server speaks Connect JSON only"
        )
    try:
        message = json.loads(body or b"{}")
    except ValueError as exc:
        raise ConnectError("invalid_argument", f"the request is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ConnectError("invalid_argument", "the request must be a JSON object")
    return message


def timeout_s(request: Request) -> float | None:
    """The client's deadline (Connect-Timeout-Ms), if any."""
    raw = request.headers.get("connect-timeout-ms")
    if raw is None:
        return None
    try:
        ms = int(raw)
    except ValueError:
        raise ConnectError("invalid_argument", f"Connect-Timeout-Ms {raw!r}") from None
    return ms / 1000 if ms > 0 else None


def stream_response(
    messages: AsyncIterator[dict[str, Any]], request: Request | None = None
) -> StreamingResponse:
    """A server stream: each message as an envelope, then end-of-stream
    (with the error if the iterator raised one). On Abort the connection
    is reset where the server can (api/h2c.py), else closed mid-body."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for m in messages:
                yield envelope(m)
        except Abort:
            raise  # RequestContext resets the connection
        except Exception as exc:
            yield end_stream(exc)
            return
        yield end_stream()

    return StreamingResponse(body(), media_type=STREAM_TYPE)


def stream_error(exc: Exception) -> StreamingResponse:
    """A stream that fails before its first message: still HTTP 200."""

    async def body() -> AsyncIterator[bytes]:
        yield end_stream(exc)

    return StreamingResponse(body(), media_type=STREAM_TYPE)
