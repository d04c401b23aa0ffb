"""E2B's control API (api.e2b.dev's routes) over a SandboxService.

A template id names what a sandbox starts from (NodeConfig.e2b_templates,
or an image of the store by its own name); `timeout` is the sandbox's TTL
from now; `metadata` and `envVars` are its labels and environment; `pause`
suspends it, `connect` and `resume` bring it back. The E2B-only parts of a
sandbox live in labels under `corral.e2b_`: the template id and the envd
access token (api/compat/e2b/envd.py checks it), which metadata never shows.
Errors are E2B's shape, `{"code": <HTTP status>, "message": ...}`.
"""

from __future__ import annotations

import base64
import binascii
import functools
import ipaddress
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import parse_qsl

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from corral import labels as platform_labels
from corral.api.compat.e2b import forks, logs, snapshots
from corral.api.models import (
    CreateSandbox,
    ExecExit,
    ExecOutput,
    ExecRequest,
    SandboxInfo,
    Usage,
)
from corral.api.service import SandboxService
from corral.api.wire import as_corral
from corral.errors import (
    Conflict,
    ImageNotFound,
    InvalidArgument,
    NotFound,
    SandboxClosed,
)
from corral.guard.policy import NetworkPolicy

ENVD_VERSION = "0.6.4"  # what Corral's envd implements (envd.py says which gates)
TEMPLATE = "corral.e2b_template"
TOKEN = platform_labels.E2B_TOKEN  # envd's access token: commands and files
TRAFFIC = platform_labels.E2B_TRAFFIC_TOKEN  # the sandbox's own ports only
DEFAULT_TIMEOUT = 300  # the SDK's own default
MAX_LIST = 1000
MAX_CONTROL_BODY = 1 << 20  # a create's or an update's JSON, at most

Resolve = Callable[[Request], Awaitable[SandboxService]]


class E2bError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def error_response(exc: Exception) -> JSONResponse:
    if isinstance(exc, E2bError):
        status, message = exc.status, exc.message
    else:
        exc = as_corral(exc)
        status, message = exc.http_status, exc.message
        if isinstance(exc, SandboxClosed):
            status = 404  # E2B: a killed sandbox is not found
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _moment(t: float) -> datetime:
    """To the microsecond, truncated: a time given back (startedAfter) must
    compare equal to the one it was read as."""
    whole = int(t)
    return datetime.fromtimestamp(whole, UTC) + timedelta(microseconds=int((t - whole) * 1e6))


def _ts(t: float | None) -> str | None:
    if t is None:
        return None
    return _moment(t).isoformat().replace("+00:00", "Z")


def metadata_of(info: SandboxInfo) -> dict[str, str]:
    return {k: v for k, v in info.labels.items() if not k.startswith("corral.")}


def _state(info: SandboxInfo) -> str:
    return "paused" if info.state.value in ("suspended", "suspending") else "running"


def detail(info: SandboxInfo, *, token: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {
        "templateID": info.labels.get(TEMPLATE, info.image),
        "sandboxID": info.id,
        "clientID": info.node,
        "startedAt": _ts(info.created_at),
        "endAt": _ts(info.expires_at) or _ts(info.created_at + 30 * 86400),
        "cpuCount": max(1, round(info.cpu)),
        "memoryMB": info.memory >> 20,
        "diskSizeMB": info.disk >> 20,
        "state": _state(info),
        "envdVersion": ENVD_VERSION,
        "metadata": metadata_of(info),
        "alias": info.labels.get(TEMPLATE),
    }
    if token:
        out["envdAccessToken"] = info.labels.get(TOKEN)
        out["domain"] = None
    return out


def created(info: SandboxInfo) -> dict[str, Any]:
    """The body of a create, connect or resume: what the SDK connects with."""
    return {
        "templateID": info.labels.get(TEMPLATE, info.image),
        "sandboxID": info.id,
        "clientID": info.node,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": info.labels.get(TOKEN),
        # Sent back by the clients on requests to the sandbox's own ports
        # (code-interpreter's 49999): ports.py lets nothing in without it.
        # A token of its own: one given to a browser to reach a port must
        # not run commands (a sandbox made before it had one: the envd token).
        "trafficAccessToken": info.labels.get(TRAFFIC, info.labels.get(TOKEN)),
        "domain": None,
        "alias": info.labels.get(TEMPLATE),
    }


START_TIMEOUT = 120.0  # a template's start command, until it says ready


def _template_of(info: SandboxInfo) -> str:
    return info.labels.get(TEMPLATE, info.image)


def metric(info: SandboxInfo, u: Usage) -> dict[str, Any]:
    """One E2B metrics sample: now. Corral keeps no history, so the CPU
    share is the average since the sandbox started."""
    cpus = max(u.cpu, 1e-9)
    alive = max(u.at - info.created_at, 1e-3)
    return {
        "timestamp": _ts(u.at), "timestampUnix": int(u.at),
        "cpuCount": max(1, round(u.cpu)),
        "cpuUsedPct": round(min(100.0, 100 * u.cpu_seconds / alive / cpus), 2),
        "memUsed": u.memory_used, "memTotal": u.memory_limit, "memCache": 0,
        "diskUsed": u.disk_used or 0, "diskTotal": u.disk_limit or info.disk,
    }  # fmt: skip


def template_spec(templates: dict[str, str], template: str) -> tuple[dict[str, Any], str | None]:
    """CreateSandbox fields for a template id, and its start command:
    NodeConfig.e2b_templates' "IMAGE [workspace=REF] [toolkit=REF,REF]
    [memory=SIZE] [cpu=N] [disk=SIZE] [kind=KIND] [start=PATH]", or the id
    as an image (a container).
    A start command runs as root once the sandbox is up; the create answers
    when it exits 0 (E2B's start command and ready check in one)."""
    spec = templates.get(template)
    if spec is None:
        return {"image": template}, None
    image, *rest = spec.split()
    out: dict[str, Any] = {"image": image}
    start = None
    for part in rest:
        key, eq, value = part.partition("=")
        if not eq or not value:
            key = ""  # not KEY=VALUE: refused below
        if key == "workspace":
            out["workspace"] = value
        elif key == "toolkit":
            out["toolkit"] = [v for v in value.split(",") if v]
        elif key in ("memory", "cpu", "disk", "kind"):
            out[key] = value
        elif key == "start" and value.startswith("/"):
            start = value
        else:
            raise E2bError(
                500,
                f"template {template!r}: {part!r} is not workspace=, toolkit=, memory=, "
                "cpu=, disk=, kind= or start=/ABSOLUTE/PATH",
            )
    return out, start


async def _start(svc: SandboxService, sandbox_id: str, cmd: str) -> None:
    """Run the template's start command; E2bError with its output if it fails."""
    req = ExecRequest(cmd=[cmd], user="root", cwd="/", timeout=START_TIMEOUT)
    err = bytearray()
    code: int | None = None
    async for ev in svc.exec(sandbox_id, req):
        if isinstance(ev, ExecOutput):
            err += ev.data
        elif isinstance(ev, ExecExit):
            code = -1 if ev.timed_out else ev.exit_code
    if code != 0:
        tail = err[-1500:].decode(errors="replace")
        raise E2bError(500, f"the template's start command {cmd} failed ({code}): {tail}")


async def _body(request: Request) -> dict[str, Any]:
    held = bytearray()
    async for chunk in request.stream():  # a control request is a small JSON document
        held += chunk
        if len(held) > MAX_CONTROL_BODY:
            raise E2bError(413, f"the request body is larger than {MAX_CONTROL_BODY} bytes")
    raw = bytes(held)
    if not raw:
        return {}
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise E2bError(400, f"the request body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise E2bError(400, "the request body must be a JSON object")
    return doc


def _timeout(
    doc: dict[str, Any], default: int | None = DEFAULT_TIMEOUT, *, least: int = 1
) -> int | None:
    t = doc.get("timeout", default)
    if t is None:
        return None
    if not isinstance(t, int) or isinstance(t, bool) or not least <= t <= 30 * 86400:
        raise E2bError(400, f"timeout must be whole seconds from {least} to 30 days: {t!r}")
    return t


def _on_timeout(doc: dict[str, Any]) -> str:
    """E2B's lifecycle as Corral's on_expiry: `autoPause` suspends the
    sandbox at its timeout (its memory kept, unless `autoPauseMemory` is
    false: to disk). `autoResume` is accepted and changes nothing: any
    request to a paused Corral sandbox but /health resumes it."""
    for name in ("autoPause", "autoPauseMemory"):
        if not isinstance(doc.get(name, False), bool):
            raise E2bError(400, f"{name} must be true or false: {doc[name]!r}")
    if not doc.get("autoPause"):
        return "close"
    return "suspend" if doc.get("autoPauseMemory", True) else "disk"


def _strings(doc: dict[str, Any], field: str) -> dict[str, str]:
    v = doc.get(field) or {}
    if not isinstance(v, dict) or not all(
        isinstance(k, str) and isinstance(x, str) for k, x in v.items()
    ):
        raise E2bError(400, f"{field} must be an object of strings")
    return v


# E2B network fields Corral has no twin for: refused by name, never ignored.
_NO_TWIN = ("egressProxy", "rules", "maskRequestHost")


def network_of(doc: dict[str, Any]) -> NetworkPolicy | None:
    """E2B's egress rules as Corral's policy. Corral's sandboxes reach only
    what they are given (no network by default), so `allowOut` is the whole
    policy: its CIDRs and IPs, and its domains, on any port.
    `allow_internet_access` alone opens nothing (docs/e2b.md), and `denyOut`
    narrows nothing that is not already closed (E2B's allow entries win over
    its deny entries)."""
    net = doc.get("network")
    if net is None:
        net = {}
    if not isinstance(net, dict):
        raise E2bError(400, "network must be an object")
    for name in _NO_TWIN:
        if net.get(name):
            raise E2bError(400, f"network.{name} is not supported by Corral: {net[name]!r}")
    for name in ("allowOut", "denyOut"):
        if not isinstance(net.get(name) or [], list) or not all(
            isinstance(x, str) for x in net.get(name) or []
        ):
            raise E2bError(400, f"network.{name} must be a list of strings")
    allow: list[str] = net.get("allowOut") or []
    if not allow:
        return None
    cidrs, domains = [], []
    for entry in allow:
        try:
            ipaddress.ip_network(entry, strict=False)
            cidrs.append(entry)
        except ValueError:
            domains.append(entry)
    try:
        return NetworkPolicy(domains=domains, cidrs=cidrs, ports=[])
    except ValueError as exc:
        raise E2bError(400, f"network.allowOut: {_first_error(exc)}") from None


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        return str(errors()[0]["msg"])
    return str(exc)


def router(
    resolve: Resolve, templates: dict[str, str], on_kill: Callable[[str], None]
) -> APIRouter:
    r = APIRouter()

    def guarded(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        """An endpoint whose errors are E2B's shape (FastAPI reads the
        signature through functools.wraps: request, then path parameters)."""

        @functools.wraps(fn)
        async def call(request: Request, **kw: Any) -> Any:
            try:
                return await fn(request, **kw)
            except Exception as exc:
                return error_response(exc)

        return call

    async def _get(svc: SandboxService, sandbox_id: str) -> SandboxInfo:
        try:
            info = await svc.get(sandbox_id)
        except (NotFound, InvalidArgument):  # a malformed id names no sandbox either
            raise E2bError(404, f"sandbox {sandbox_id!r} not found") from None
        if info.state.value in ("closed", "failed", "closing") or TOKEN not in info.labels:
            # Not a live E2B sandbox of this caller: E2B says not found.
            raise E2bError(404, f"sandbox {sandbox_id!r} not found")
        return info

    @guarded
    async def create(request: Request) -> Any:
        svc = await resolve(request)
        doc = await _body(request)
        template = doc.get("templateID")
        if not isinstance(template, str) or not template:
            raise E2bError(400, "templateID is required")
        metadata = _strings(doc, "metadata")
        if any(k.startswith("corral.") for k in metadata):
            raise E2bError(400, "metadata keys starting with 'corral.' are the platform's")
        snapshot = None if template in templates else await snapshots.create_fields(svc, template)
        spec, start = (snapshot, None) if snapshot else template_spec(templates, template)
        ttl = _timeout(doc)
        on_expiry = _on_timeout(doc)
        try:
            req = CreateSandbox.model_validate({
                **spec,
                # Its timeout runs from when it is handed out: a start command
                # slower than it (Jupyter's on a loaded host) must not see the
                # sandbox closed under it. Set again once the start is done.
                "ttl": ttl + START_TIMEOUT if start and ttl else ttl,
                "idle_timeout": None,
                "on_expiry": on_expiry,
                "env": _strings(doc, "envVars"),
                "network": network_of(doc),
                "labels": {**metadata, TEMPLATE: template, TOKEN: secrets.token_urlsafe(24),
                           TRAFFIC: secrets.token_urlsafe(24)},
            })  # fmt: skip
        except ValueError as exc:
            raise E2bError(400, f"bad sandbox request: {exc}") from None
        try:
            info = await svc.create(req)
        except ImageNotFound:
            raise E2bError(404, f"template '{template}' not found") from None
        except InvalidArgument as exc:
            raise E2bError(400, exc.message) from None
        if start is not None:
            try:
                await _start(svc, info.id, start)
                if ttl:
                    await svc.set_ttl(info.id, ttl)
            except BaseException:
                await svc.close(info.id)  # no half-started sandbox stays behind
                raise
        return JSONResponse(created(info), status_code=201)

    @guarded
    async def list_v2(request: Request) -> Any:
        svc = await resolve(request)
        q = request.query_params
        wanted = {s for s in (q.get("state") or "running,paused").split(",") if s}
        if not wanted <= {"running", "paused"}:
            raise E2bError(400, f"state must be running and/or paused: {q.get('state')!r}")
        try:
            limit = int(q.get("limit") or 100)
        except ValueError:
            raise E2bError(400, f"limit must be a number: {q.get('limit')!r}") from None
        if not 1 <= limit <= MAX_LIST:
            raise E2bError(400, f"limit must be between 1 and {MAX_LIST}: {limit}")
        order = q.get("order") or "desc"
        if order not in ("asc", "desc"):
            raise E2bError(400, f"order must be asc or desc: {order!r}")
        since = _since(q.get("startedAfter"))
        template = q.get("template")
        labels = dict(parse_qsl(q.get("metadata") or "", keep_blank_values=True))
        found = [
            i for i in await svc.list(labels or None)
            if TOKEN in i.labels and i.state.value not in ("closed", "failed", "closing")
            and _state(i) in wanted
            and (since is None or _moment(i.created_at) >= since)
            and (template is None or i.labels.get(TEMPLATE) == template)
        ]  # fmt: skip
        desc = order == "desc"
        found.sort(key=lambda i: (i.created_at, i.id), reverse=desc)
        after = _cursor(q.get("nextToken"))
        if after is not None:
            found = [i for i in found if ((i.created_at, i.id) < after) == desc
                     and (i.created_at, i.id) != after]  # fmt: skip
        page, more = found[:limit], len(found) > limit
        headers = {}
        if more:
            last = page[-1]
            headers["x-next-token"] = base64.urlsafe_b64encode(
                json.dumps([last.created_at, last.id]).encode()
            ).decode()
        return JSONResponse([detail(i) for i in page], headers=headers)

    @guarded
    async def get(request: Request, sandbox_id: str) -> Any:
        svc = await resolve(request)
        return detail(await _get(svc, sandbox_id), token=True)

    @guarded
    async def kill(request: Request, sandbox_id: str) -> Any:
        svc = await resolve(request)
        await _get(svc, sandbox_id)
        await svc.close(sandbox_id)
        # Its envd streams drop now, as E2B's do; after the close, so that a
        # client asking /health on the dropped stream hears it is gone.
        on_kill(sandbox_id)
        return Response(status_code=204)

    @guarded
    async def set_timeout(request: Request, sandbox_id: str) -> Any:
        svc = await resolve(request)
        # 0: the timeout is now (a sandbox made with autoPause pauses).
        t = _timeout(await _body(request), None, least=0)
        if t is None:
            raise E2bError(400, "timeout is required")
        await _get(svc, sandbox_id)
        await svc.set_ttl(sandbox_id, t)
        return Response(status_code=204)

    @guarded
    async def set_network(request: Request, sandbox_id: str) -> Any:
        svc = await resolve(request)
        doc = await _body(request)
        policy = network_of({"network": doc})
        await _get(svc, sandbox_id)
        try:
            await svc.update_network(sandbox_id, policy or NetworkPolicy(ports=[]))
        except Conflict as exc:
            raise E2bError(409, exc.message) from None
        return Response(status_code=204)

    @guarded
    async def metrics(request: Request, sandbox_id: str) -> Any:
        svc = await resolve(request)
        info = await _get(svc, sandbox_id)
        for name in ("start", "end"):
            raw = request.query_params.get(name)
            if raw is not None and not raw.isdigit():
                raise E2bError(400, f"{name} must be Unix seconds: {raw!r}")
        u = await svc.usage(sandbox_id)
        end = request.query_params.get("end")
        start = request.query_params.get("start")
        if (end is not None and int(end) < u.at - 1) or (start is not None and int(start) > u.at):
            return JSONResponse([])  # only "now" is kept, and it is outside the window
        return JSONResponse([metric(info, u)])

    @guarded
    async def pause(request: Request, sandbox_id: str) -> Any:
        svc = await resolve(request)
        memory = (await _body(request)).get("memory", True)
        if not isinstance(memory, bool):
            raise E2bError(400, f"memory must be true or false: {memory!r}")
        info = await _get(svc, sandbox_id)
        if _state(info) == "paused":
            raise E2bError(409, f"sandbox {sandbox_id!r} is already paused")
        try:
            # E2B's filesystem-only pause gives the sandbox's memory back;
            # Corral's disk depth does that and keeps its processes too (saved
            # with it) where E2B's cold-boots: docs/e2b.md.
            await svc.suspend(sandbox_id, "" if memory else "disk")
        except Conflict as exc:
            raise E2bError(409, exc.message) from None
        return Response(status_code=204)

    async def _wake(svc: SandboxService, sandbox_id: str, doc: dict[str, Any]) -> SandboxInfo:
        info = await _get(svc, sandbox_id)
        if _state(info) == "paused":
            info = await svc.resume(sandbox_id)
        t = _timeout(doc, None)
        left = None if info.expires_at is None else info.expires_at - time.time()
        if t is not None and (left is None or t > left):
            info = await svc.set_ttl(sandbox_id, t)  # connect extends, never shortens
        return info

    @guarded
    async def connect(request: Request, sandbox_id: str) -> Any:
        svc = await resolve(request)
        return JSONResponse(created(await _wake(svc, sandbox_id, await _body(request))))

    @guarded
    async def resume(request: Request, sandbox_id: str) -> Any:
        svc = await resolve(request)
        info = await _get(svc, sandbox_id)
        if _state(info) != "paused":
            raise E2bError(409, f"sandbox {sandbox_id!r} is not paused")
        woken = await _wake(svc, sandbox_id, await _body(request))
        return JSONResponse(created(woken), status_code=201)

    r.include_router(snapshots.router(resolve, _get, _template_of, error_response))
    r.include_router(logs.router(resolve, _get, error_response))
    r.include_router(forks.router(resolve, _get, _body, _timeout, created, error_response))
    r.add_api_route("/sandboxes", create, methods=["POST"])
    r.add_api_route("/v2/sandboxes", create, methods=["POST"])  # e2b >= 2.5x creates here
    r.add_api_route("/v2/sandboxes", list_v2, methods=["GET"])
    r.add_api_route("/sandboxes/{sandbox_id}", get, methods=["GET"])
    r.add_api_route("/sandboxes/{sandbox_id}", kill, methods=["DELETE"])
    r.add_api_route("/sandboxes/{sandbox_id}/timeout", set_timeout, methods=["POST"])
    r.add_api_route("/sandboxes/{sandbox_id}/network", set_network, methods=["PUT"])
    r.add_api_route("/sandboxes/{sandbox_id}/metrics", metrics, methods=["GET"])
    r.add_api_route("/sandboxes/{sandbox_id}/pause", pause, methods=["POST"])
    r.add_api_route("/sandboxes/{sandbox_id}/connect", connect, methods=["POST"])
    r.add_api_route("/sandboxes/{sandbox_id}/resume", resume, methods=["POST"])
    return r


def _since(raw: str | None) -> datetime | None:
    if not raw:
        return None
    try:
        t = datetime.fromisoformat(raw.replace("Z", "+00:00"))
    except ValueError:
        raise E2bError(400, f"startedAfter must be an RFC 3339 time: {raw!r}") from None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def _cursor(token: str | None) -> tuple[float, str] | None:
    if not token:
        return None
    try:
        created_at, sandbox_id = json.loads(base64.urlsafe_b64decode(token.encode()))
    except (ValueError, TypeError, binascii.Error):
        created_at = sandbox_id = None
    if not isinstance(created_at, int | float) or not isinstance(sandbox_id, str):
        raise E2bError(400, f"nextToken is not one this server gave: {token!r}")
    return float(created_at), sandbox_id
