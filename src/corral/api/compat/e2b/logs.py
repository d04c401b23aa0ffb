"""E2B's sandbox logs over Corral's command log: what the platform saw run
in the sandbox (argv, user, outcome, exit code, output sizes), one entry per
command. The sandbox cannot write to it: it is kept on the host.

  GET /sandboxes/{id}/logs?start=<ms>&limit=N      {"logs", "logEntries"}
  GET /v2/sandboxes/{id}/logs?cursor=<ms>&limit=N&direction=&level=&search=
                                                   {"logs": [entries]}
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from corral.api.models import LogLine

MAX_LIMIT = 1000
LEVELS = ("debug", "info", "warn", "error")


class LogsError(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def _ts(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def entry(line: LogLine) -> dict[str, Any]:
    """One E2B log entry: a failed command is a warning."""
    try:
        doc = json.loads(line.line)
    except ValueError:
        doc = {}
    if not isinstance(doc, dict):
        doc = {}
    failed = doc.get("outcome") not in (None, "ok") or doc.get("exit_code", 0) != 0
    argv = " ".join(str(a) for a in doc.get("argv") or [])
    message = f"{doc.get('event') or 'command'}: {argv}".strip(": ")
    fields = {k: str(v) for k, v in doc.items() if k not in ("ts", "argv")}
    return {"timestamp": _ts(line.ts), "level": "warn" if failed else "info",
            "message": message, "fields": fields}  # fmt: skip


def _int(q: Any, name: str, default: int) -> int:
    raw = q.get(name)
    if raw is None or raw == "":
        return default
    if not str(raw).isdigit():
        raise LogsError(f"{name} must be a whole number: {raw!r}")
    return int(raw)


def router(resolve: Any, get_sandbox: Any, error_response: Any) -> APIRouter:
    r = APIRouter()

    async def lines(request: Request, sandbox_id: str, since_ms: int) -> list[LogLine]:
        svc = await resolve(request)
        await get_sandbox(svc, sandbox_id)
        limit = _int(request.query_params, "limit", MAX_LIMIT)
        if not 1 <= limit <= MAX_LIMIT:
            raise LogsError(f"limit must be between 1 and {MAX_LIMIT}: {limit}")
        got: list[LogLine] = await svc.command_log(sandbox_id, since_ms, limit)
        return got

    async def v1(request: Request, sandbox_id: str) -> Any:
        try:
            got = await lines(request, sandbox_id, _int(request.query_params, "start", 0))
        except LogsError as exc:
            return JSONResponse({"code": 400, "message": exc.message}, status_code=400)
        except Exception as exc:
            return error_response(exc)
        return {"logs": [{"timestamp": _ts(x.ts), "line": x.line} for x in got],
                "logEntries": [entry(x) for x in got]}  # fmt: skip

    async def v2(request: Request, sandbox_id: str) -> Any:
        q = request.query_params
        try:
            direction = q.get("direction") or "forward"
            if direction not in ("forward", "backward"):
                raise LogsError(f"direction must be forward or backward: {direction!r}")
            level = q.get("level")
            if level is not None and level not in LEVELS:
                raise LogsError(f"level must be one of {', '.join(LEVELS)}: {level!r}")
            cursor = _int(q, "cursor", 0)
            got = await lines(request, sandbox_id, 0 if direction == "backward" else cursor)
        except LogsError as exc:
            return JSONResponse({"code": 400, "message": exc.message}, status_code=400)
        except Exception as exc:
            return error_response(exc)
        if direction == "backward":
            got = [x for x in got if not cursor or x.ts * 1000 <= cursor][::-1]
        out = [entry(x) for x in got]
        if level is not None:
            out = [e for e in out if LEVELS.index(e["level"]) >= LEVELS.index(level)]
        if q.get("search"):
            out = [e for e in out if q["search"] in e["message"] or q["search"] in str(e["fields"])]
        return {"logs": out}

    r.add_api_route("/sandboxes/{sandbox_id}/logs", v1, methods=["GET"])
    r.add_api_route("/v2/sandboxes/{sandbox_id}/logs", v2, methods=["GET"])
    return r
