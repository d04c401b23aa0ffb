"""Structured logs: one JSON object per line, an event name plus fields.

log = get_logger("corral.node")
log.info("sandbox.created", sandbox=sid, ms=12.5)
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
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
    handler.setFormatter(_JsonFormatter())
    root.addHandler(handler)
    root.propagate = False
    _configured = True
    logging.Formatter.converter = time.gmtime
