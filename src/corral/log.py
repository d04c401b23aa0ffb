"""Structured logs: one JSON object per line, an event name plus fields.

log = get_logger("corral.node")
log.info("sandbox.created", sandbox=sid, ms=12.5)

Each line also carries the fields of its context, set where a request
enters instead of passed by every call: `request_id` (the HTTP API's
middleware, api/serving.py), `sandbox` (that middleware, from the path;
the node's create, once it has made the id), `project` (the gateway, once
it knows the caller's). Fields given to the call win over the context's.
With tracing on (corral/trace.py), `trace_id` and `span_id` too.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar, Token
from typing import Any

from corral import trace

# The context's fields (one dict, replaced whole, never mutated: a task
# started under it keeps the fields it started with).
_CONTEXT: ContextVar[dict[str, str] | None] = ContextVar("corral_log_context", default=None)


def bind(**fields: str | None) -> Token[dict[str, str] | None]:
    """Add fields to the current context (None values are skipped); undo
    with unbind(token), or leave it to an enclosing scope()."""
    new = {**(_CONTEXT.get() or {}), **{k: v for k, v in fields.items() if v is not None}}
    return _CONTEXT.set(new)


def unbind(token: Token[dict[str, str] | None]) -> None:
    _CONTEXT.reset(token)


@contextmanager
def scope(**fields: str | None) -> Iterator[None]:
    """The fields for the block, and whatever bind() adds inside it undone
    at its end (a coroutine's scope, never an async generator's)."""
    token = bind(**fields)
    try:
        yield
    finally:
        # A task abandoned at loop teardown is closed by the garbage
        # collector from another context: nothing of its own to undo there.
        with suppress(ValueError):
            _CONTEXT.reset(token)


def context_fields() -> dict[str, str]:
    return dict(_CONTEXT.get() or {})


def new_request_id() -> str:
    return os.urandom(8).hex()


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        ctx = _CONTEXT.get()
        if ctx:
            out.update(ctx)
        ids = trace.ids()
        if ids is not None:
            out["trace_id"], out["span_id"] = ids
        out.update(getattr(record, "fields", {}))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class StructLogger:
    def __init__(self, name: str) -> None:
        self._log = logging.getLogger(name)

    def _emit(self, level: int, event: str, fields: dict[str, Any], exc: bool = False) -> None:
        if self._log.isEnabledFor(level):
            self._log.log(level, event, extra={"fields": fields}, exc_info=exc)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, event, fields)

    def error(self, event: str, exc: bool = False, **fields: Any) -> None:
        self._emit(logging.ERROR, event, fields, exc)


def get_logger(name: str) -> StructLogger:
    return StructLogger(name)


_configured = False


def configure(level: str | None = None) -> None:
    """Send corral's logs to stderr as JSON lines (idempotent).

    The level comes from the argument, else CORRAL_LOG_LEVEL, else WARNING:
    an embedded client stays quiet unless asked."""
    global _configured
    root = logging.getLogger("corral")
    root.setLevel((level or os.environ.get("CORRAL_LOG_LEVEL") or "WARNING").upper())
    if _configured:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root.addHandler(handler)
    root.propagate = False
    _configured = True
    logging.Formatter.converter = time.gmtime
