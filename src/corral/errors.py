"""Corral's exceptions: one root, a closed table of wire codes.

    CorralError
     +-- InvalidArgument              400 invalid_argument
     +-- Unauthenticated              401 unauthenticated
     +-- PermissionDenied             403 permission_denied
     +-- NotFound                     404 not_found
     |    +-- SandboxNotFound         404 sandbox_not_found
     |    +-- ImageNotFound           404 image_not_found
     |    +-- FileNotFound            404 file_not_found   (also a FileNotFoundError)
     |    +-- CommandNotFound         404 command_not_found
     +-- SandboxClosed                409 sandbox_closed
     +-- Conflict                     409 conflict
     |    +-- Ambiguous               409 ambiguous        (ran or not: nobody can tell)
     +-- CommandTimeout               408 command_timeout  (also a TimeoutError)
     +-- ResourceExhausted            429 resource_exhausted
     |    +-- NodeFull                429 node_full        (this node; another may take it)
     +-- FileError                    422 file_error       (an OS error inside the sandbox)
     +-- SandboxFailed                500 sandbox_failed
     +-- SandboxLost                  410 sandbox_lost     (its node died; not recreated)
     +-- Unavailable                  503 unavailable
     +-- InternalError                500 internal

Over HTTP an error travels as ``{"error": {"code", "message", ...details}}``
and is rebuilt from the code through ``ERROR_CODES``: never from a class path
sent by the peer, so a server cannot make a client instantiate anything else.
"""

from __future__ import annotations

from typing import Any, ClassVar


class CorralError(Exception):
    """Root of every error Corral raises on purpose."""

    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        body.update({k: _jsonable(v) for k, v in self.details.items()})
        return body


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


class InvalidArgument(CorralError):
    """A request field broke a rule. Names the field, the rule and the value."""

    code = "invalid_argument"
    http_status = 400

    def __init__(self, field: str, rule: str, value: Any, message: str | None = None) -> None:
        shown = _show(value)
        super().__init__(
            message or f"{field}: {rule} (got {shown})", field=field, rule=rule, value=shown
        )
        self.field = field
        self.rule = rule
        # Never keep a (possibly huge) buffer alive in an exception.
        self.value = shown if isinstance(value, (bytes, bytearray, memoryview)) else value


def _show(value: Any) -> Any:
    """A short, safe rendering of a bad value for an error message."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"<{len(value)} bytes>"
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


class Unauthenticated(CorralError):
    code = "unauthenticated"
    http_status = 401


class PermissionDenied(CorralError):
    code = "permission_denied"
    http_status = 403


class NotFound(CorralError):
    code = "not_found"
    http_status = 404


class SandboxNotFound(NotFound):
    code = "sandbox_not_found"


class ImageNotFound(NotFound):
    code = "image_not_found"


class FileNotFound(NotFound, FileNotFoundError):
    code = "file_not_found"


class CommandNotFound(NotFound):
    code = "command_not_found"


class SandboxClosed(CorralError):
    code = "sandbox_closed"
    http_status = 409


class Conflict(CorralError):
    code = "conflict"
    http_status = 409


class Ambiguous(Conflict):
    """A keyed operation (a rollout step) started but its outcome was lost
    with the process that ran it: it may have had its effects or not. It
    is never run again behind the caller's back (that could do it twice)."""

    code = "ambiguous"


class CommandTimeout(CorralError, TimeoutError):
    """A command ran past its timeout and was killed with its process tree."""

    code = "command_timeout"
    http_status = 408


class ResourceExhausted(CorralError):
    code = "resource_exhausted"
    http_status = 429


class NodeFull(ResourceExhausted):
    """One node cannot take the sandbox (slots, memory, disk, pressure):
    a gateway places it elsewhere. Unlike its parent (a quota, or every
    node full), retrying on another node may succeed."""

    code = "node_full"

    def __init__(self, message: str, *, node: str, reason: str, **details: Any) -> None:
        super().__init__(message, node=node, reason=reason, **details)


class FileError(CorralError):
    """A file operation failed inside the sandbox; ``errno`` says why."""

    code = "file_error"
    http_status = 422


class SandboxFailed(CorralError):
    code = "sandbox_failed"
    http_status = 500


class SandboxLost(CorralError):
    """The sandbox's node stopped answering (died, partitioned, stopped
    heartbeating) and the sandbox is written off: it is never recreated
    behind the caller's back, whose rollout must decide what to do."""

    code = "sandbox_lost"
    http_status = 410


class Unavailable(CorralError):
    code = "unavailable"
    http_status = 503


class InternalError(CorralError):
    code = "internal"
    http_status = 500


ERROR_CODES: dict[str, type[CorralError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        Unauthenticated,
        PermissionDenied,
        NotFound,
        SandboxNotFound,
        ImageNotFound,
        FileNotFound,
        CommandNotFound,
        SandboxClosed,
        Conflict,
        Ambiguous,
        CommandTimeout,
        ResourceExhausted,
        NodeFull,
        FileError,
        SandboxFailed,
        SandboxLost,
        Unavailable,
        InternalError,
    )
}


def error_from_wire(body: dict[str, Any], http_status: int = 500) -> CorralError:
    """Rebuild an error from its wire form. Unknown codes become InternalError."""
    code = str(body.get("code", "internal"))
    message = str(body.get("message", f"HTTP {http_status}"))
    details = {k: v for k, v in body.items() if k not in ("code", "message")}
    cls = ERROR_CODES.get(code, InternalError)
    if cls is InvalidArgument:
        return InvalidArgument(
            str(details.get("field", "?")),
            str(details.get("rule", "?")),
            details.get("value"),
            message=message,
        )
    err = cls.__new__(cls)
    CorralError.__init__(err, message, **details)
    return err
