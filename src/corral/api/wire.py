"""The two wire formats both sides of the HTTP API parse, so they are
written once: labels in a query (``label=key=value``, repeated) and a
command's NDJSON event stream (one JSON object a line: started,
stdout/stderr with base64 data, exit, or error).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from corral import log
from corral.api.models import ExecEvent, ExecExit, ExecOutput, ExecStarted
from corral.errors import CorralError, InternalError, InvalidArgument, error_from_wire

_log = log.get_logger("corral.api")

# The dashboard's login cookie: it holds an API key (dashboard/auth.py).
# Under https it is __Host- prefixed: no sibling host can set one in its
# place (a browser refuses a __Host- cookie with a Domain), and it wins.
KEY_COOKIE = "corral_key"
KEY_COOKIE_SECURE = "__Host-corral_key"
KEY_COOKIES = (KEY_COOKIE_SECURE, KEY_COOKIE)


def key_cookie(cookies: dict[str, str]) -> str:
    """The login cookie's key, the __Host- one first."""
    return next((cookies[n] for n in KEY_COOKIES if cookies.get(n)), "")


class StreamCut(Exception):
    """End a response mid-body on purpose: its source (a sandbox's server,
    a killed process) went away, and the client must see a dropped
    connection, not an answer that looks whole. An expected event, not the
    server's fault: RequestContext (api/serving.py) resets the connection
    and it is logged as info, without a traceback."""


def as_corral(exc: BaseException) -> CorralError:
    """What a caller is told of `exc`. A CorralError is meant for them; any
    other exception is a bug or a host fault whose text can name host paths,
    addresses or another tenant's ids, so it is logged here with its
    traceback and the caller gets only the request id to quote."""
    if isinstance(exc, CorralError):
        return exc
    if isinstance(exc, StreamCut):
        _log.info("api.stream_cut", reason=str(exc))
        return InternalError(str(exc))  # never sent: the answer had begun
    rid = log.context_fields().get("request_id")
    _log.error("api.unexpected", exc=True, error=f"{type(exc).__name__}: {exc}")
    where = f" (request {rid})" if rid else ""
    return InternalError(f"internal error{where}: the server's log has the details", request_id=rid)


def label_pairs(wire: str, labels: dict[str, str] | None) -> list[tuple[str, str]]:
    """`labels` as query pairs, one ``wire=key=value`` each."""
    return [(wire, f"{k}={v}") for k, v in (labels or {}).items()]


def parse_labels(items: Iterable[str]) -> dict[str, str]:
    """The inverse of label_pairs' values; a value without '=' (or with an
    empty key) is refused naming the parameter."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidArgument("label", "must be key=value", item)
        out[key] = value
    return out


def event_line(event: ExecEvent) -> bytes:
    return event.model_dump_json().encode() + b"\n"


def error_line(exc: Exception) -> bytes:
    """The last line of a stream that failed after it began (an error
    that is not a CorralError is reported as internal)."""
    err = as_corral(exc)
    return json.dumps({"type": "error", "error": err.to_wire()}).encode() + b"\n"


def read_event(line: str) -> ExecEvent | None:
    """One line of the stream: its event, None for a line to skip (blank,
    or a type this client does not know), or the error it carries, raised."""
    if not line:
        return None
    doc = json.loads(line)
    kind = doc.get("type")
    if kind == "started":
        return ExecStarted.model_validate(doc)
    if kind in ("stdout", "stderr"):
        # From the text, not the dict: bytes are validated from base64 only
        # in JSON mode.
        return ExecOutput.model_validate_json(line)
    if kind == "exit":
        return ExecExit.model_validate(doc)
    if kind == "error":
        raise error_from_wire(doc["error"])
    return None
