"""E2B's snapshots over Corral's commit: `POST /sandboxes/{id}/snapshots`
makes one, `GET /snapshots` lists them, `DELETE /templates/{id}` drops one,
and a create whose templateID is a snapshot's id starts from it.

A snapshot is the sandbox's writable layer committed as a toolkit layer
(the sandbox keeps running). Its id is `snapshots:<name>` (a name given, or
`snapshot-<hex>`); it is tagged with its id, and through a gateway with its
id under the sandbox's project's own names (projects/<project>/snapshots:
<name>), which the gateway lists and deletes for that project alone
(control/project_layers.py). Its labels say what it sits on, by digest, so
that a base retagged later does not move it:
  e2b.snapshot  "1"
  e2b.name      its name
  e2b.sandbox   the sandbox it was taken of
  e2b.spec      {"image", "workspace", "toolkit", "memory", "cpu", "disk",
                 "template"}: the sandbox's layers and size
It holds files, not processes (E2B's also keeps memory): a sandbox made from
it starts afresh on the files. Snapshots made before ids had this form keep
the id they were given (`<name>:latest`).
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

from corral import labels as platform_labels
from corral.api.models import CommitRequest, LayerInfo, SandboxInfo
from corral.api.service import SandboxService
from corral.errors import Conflict, ImageNotFound, Unavailable

SNAPSHOT = "e2b.snapshot"
NAME = "e2b.name"
REPO = "snapshots"  # an id is REPO:<name>; the name is a tag, where '_' is allowed
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,62}$")
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


def snapshot_id(name: str) -> str:
    """A tag as the snapshot id E2B's clients see: without the project's
    prefix a gateway's tags carry (the gateway lists only the project's)."""
    return name.rpartition("/")[2] if name.startswith(platform_labels.PROJECT_IMAGES) else name


async def find(svc: SandboxService, wanted: str) -> LayerInfo | None:
    for layer in await svc.list_layers({SNAPSHOT: "1"}):
        if any(snapshot_id(n) == wanted for n in layer.names):
            return layer
    return None


async def create_fields(svc: SandboxService, template: str) -> dict[str, Any] | None:
    """CreateSandbox fields for a snapshot's id; None if it names none."""
    if not template.startswith(f"{REPO}:") and not template.endswith(":latest"):
        return None  # not a snapshot's id (those from before: NAME:latest)
    try:
        layer = await find(svc, template)
    except Unavailable:  # no node answered: as if there were none
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
    names = [snapshot_id(n) for n in layer.names]
    return {"snapshotID": names[0], "names": names}


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
            given = name is not None
            if name is None:
                name = f"snapshot-{secrets.token_hex(8)}"
            elif not isinstance(name, str) or not _NAME.match(name):
                raise SnapshotError(
                    400, f"name must be 1-63 of a-z, 0-9, '-' and '_', starting with a letter "
                    f"or digit: {name!r}",
                )  # fmt: skip
            project = info.labels.get(platform_labels.PROJECT)
            own = platform_labels.own_images(project) if project else ""
            tag = f"{own}{REPO}:{name}"
            taken = await svc.list_layers() if given else []  # a random name takes nothing
            if any(tag in x.names and x.labels.get(SNAPSHOT) != "1" for x in taken):
                raise SnapshotError(
                    409, f"{snapshot_id(tag)!r} names an image that is not a snapshot"
                )
            spec = spec_of(info, template_of(info))
            labels = {SNAPSHOT: "1", NAME: name, "e2b.sandbox": sandbox_id,
                      "e2b.spec": json.dumps(spec)}  # fmt: skip
            req = CommitRequest(tag=tag, kind="toolkit", labels=labels)
            layer = await svc.commit(sandbox_id, req)
        except SnapshotError as exc:
            return _e2b(exc.status, exc.message)
        except ValueError as exc:
            return _e2b(400, f"the body is not JSON: {exc}")
        except Exception as exc:
            return error_response(exc)
        return JSONResponse(_info(layer.model_copy(update={"names": [tag]})), status_code=201)

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
                found = [x for x in found if q["name"] in (x.labels.get(NAME), _old_name(x))]
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
    # A path parameter: an id from before (a name with '/') must still match.
    r.add_api_route("/templates/{template_id:path}", drop, methods=["DELETE"])
    return r


def _old_name(layer: LayerInfo) -> str | None:
    """The name of a snapshot made before e2b.name (tagged `<name>:latest`)."""
    return next((n.removesuffix(":latest") for n in layer.names if n.endswith(":latest")), None)


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
