"""E2B's snapshots over Corral's commit: `POST /sandboxes/{id}/snapshots`
makes one, `GET /snapshots` lists them, `DELETE /templates/{id}` drops one,
and a create whose templateID is a snapshot's id starts from it.

A snapshot is the sandbox's writable layer committed as a toolkit layer
(the sandbox keeps running), tagged with the snapshot's id. Its labels say
what it sits on, by digest, so that a base retagged later does not move it:
  e2b.snapshot  "1"
  e2b.sandbox   the sandbox it was taken of
  e2b.spec      {"image", "workspace", "toolkit", "memory", "cpu", "disk",
                 "template"}: the sandbox's layers and size
It holds files, not processes (E2B's also keeps memory): a sandbox made from
it starts afresh on the files.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import secrets
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from corral.api.models import CommitRequest, LayerInfo, SandboxInfo
from corral.api.service import SandboxService
from corral.errors import Conflict, ImageNotFound, Unavailable

SNAPSHOT = "e2b.snapshot"
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,39}$")
MAX_LIST = 1000


class SnapshotError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def spec_of(info: SandboxInfo, template: str) -> dict[str, Any]:
    layers = list(info.layers)
    image, rest = layers[0], layers[1:]
    workspace = None
    if info.workspace:
        workspace, rest = rest[0], rest[1:]
    return {"image": image, "workspace": workspace, "toolkit": rest, "memory": info.memory,
            "cpu": info.cpu, "disk": info.disk, "template": template}  # fmt: skip


async def find(svc: SandboxService, snapshot_id: str) -> LayerInfo | None:
    for layer in await svc.list_layers({SNAPSHOT: "1"}):
        if snapshot_id in layer.names:
            return layer
    return None


async def create_fields(svc: SandboxService, template: str) -> dict[str, Any] | None:
    """CreateSandbox fields for a snapshot's id; None if it names none."""
    if ":" not in template:
        return None
    try:
        layer = await find(svc, template)
    except Unavailable:  # a gateway: it lists no layers, so no snapshots either
        return None
    if layer is None:
        return None
    spec = json.loads(layer.labels["e2b.spec"])
    fields = {k: spec[k] for k in ("image", "memory", "cpu", "disk")}
    if spec["workspace"]:
        fields["workspace"] = spec["workspace"]
    fields["toolkit"] = [*spec["toolkit"], layer.digest]
    return fields


def _info(layer: LayerInfo) -> dict[str, Any]:
    name = next(n for n in layer.names)
    return {"snapshotID": name, "names": list(layer.names)}


def router(resolve: Any, get_sandbox: Any, template_of: Any, error_response: Any) -> APIRouter:
    """`get_sandbox(svc, id)` is the control API's live-sandbox lookup (404
    otherwise); `template_of(info)` the template a sandbox was made from."""
    r = APIRouter()

    async def take(request: Request, sandbox_id: str) -> Any:
        try:
            svc = await resolve(request)
            info: SandboxInfo = await get_sandbox(svc, sandbox_id)
            raw = await request.body()
            doc = json.loads(raw) if raw else {}
            name = doc.get("name") if isinstance(doc, dict) else None
            if name is None:
                tag = f"snapshot-{secrets.token_hex(8)}:latest"
            elif not isinstance(name, str) or not _NAME.match(name):
                raise SnapshotError(400, f"name must be 1-40 of a-z, 0-9 and '-': {name!r}")
            else:
                tag = f"{name}:latest"
                taken = await svc.list_layers()
                if any(tag in x.names and x.labels.get(SNAPSHOT) != "1" for x in taken):
                    raise SnapshotError(409, f"{tag!r} names an image that is not a snapshot")
            spec = spec_of(info, template_of(info))
            labels = {SNAPSHOT: "1", "e2b.sandbox": sandbox_id, "e2b.spec": json.dumps(spec)}
            req = CommitRequest(tag=tag, kind="toolkit", labels=labels)
            layer = await svc.commit(sandbox_id, req)
        except SnapshotError as exc:
            return _e2b(exc.status, exc.message)
        except ValueError as exc:
            return _e2b(400, f"the body is not JSON: {exc}")
        except Exception as exc:
            return error_response(exc)
        return JSONResponse({"snapshotID": tag, "names": list(layer.names)}, status_code=201)

    async def listed(request: Request) -> Any:
        try:
            svc = await resolve(request)
            q = request.query_params
            limit = int(q["limit"]) if (q.get("limit") or "").isdigit() else 100
            if not 1 <= limit <= MAX_LIST:
                raise SnapshotError(400, f"limit must be between 1 and {MAX_LIST}: {limit}")
            want = {SNAPSHOT: "1"}
            if q.get("sandboxID"):
                want["e2b.sandbox"] = q["sandboxID"]
            found = [x for x in await svc.list_layers(want) if x.names]
            if q.get("name"):
                found = [x for x in found if f"{q['name']}:latest" in x.names]
            found.sort(key=lambda x: (x.created, x.digest), reverse=True)
            start = _offset(q.get("nextToken"))
            page = found[start : start + limit]
            headers = {}
            if start + limit < len(found):
                headers["x-next-token"] = base64.urlsafe_b64encode(
                    str(start + limit).encode()
                ).decode()
        except SnapshotError as exc:
            return _e2b(exc.status, exc.message)
        except Exception as exc:
            return error_response(exc)
        return JSONResponse([_info(x) for x in page], headers=headers)

    async def drop(request: Request, template_id: str) -> Any:
        try:
            svc = await resolve(request)
            layer = await find(svc, template_id)
            if layer is None:
                raise SnapshotError(404, f"template '{template_id}' not found")
            await svc.delete_layer(layer.digest)
        except SnapshotError as exc:
            return _e2b(exc.status, exc.message)
        except Conflict as exc:
            return _e2b(409, exc.message)
        except ImageNotFound:
            return JSONResponse(
                {"code": 404, "message": f"template '{template_id}' not found"}, 404
            )
        except Exception as exc:
            return error_response(exc)
        return Response(status_code=204)

    r.add_api_route("/sandboxes/{sandbox_id}/snapshots", take, methods=["POST"])
    r.add_api_route("/snapshots", listed, methods=["GET"])
    r.add_api_route("/templates/{template_id}", drop, methods=["DELETE"])
    return r


def _e2b(status: int, message: str) -> JSONResponse:
    return JSONResponse({"code": status, "message": message}, status_code=status)


def _offset(token: str | None) -> int:
    if not token:
        return 0
    try:
        text = base64.urlsafe_b64decode(token.encode()).decode()
    except (ValueError, binascii.Error):
        text = ""
    if not text.isdigit():
        raise SnapshotError(400, f"nextToken is not one this server gave: {token!r}")
    return int(text)
