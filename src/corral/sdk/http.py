"""SandboxService over HTTP: the SDK's remote transport to `corral serve`.

URLs: ``http://host:7070`` or ``unix:/path/to/corral.sock``.
"""

from __future__ import annotations

import builtins
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx

from corral.api.models import (
    AuditReport,
    CommitRequest,
    CreateSandbox,
    DisplayInput,
    ExecEvent,
    ExecExit,
    ExecOutput,
    ExecRequest,
    ExecStarted,
    FileEntry,
    FnCallRequest,
    FnCallResult,
    ForkRequest,
    LayerInfo,
    NetworkPolicy,
    SandboxInfo,
    SavedState,
    SaveRequest,
)
from corral.errors import (
    CorralError,
    InternalError,
    InvalidArgument,
    Unavailable,
    error_from_wire,
)

_SANDBOX_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}")


def _sid(sandbox_id: str) -> str:
    """A sandbox id as a path segment: refused here if it could be read as
    anything else ("..", a slash, a query), so a request can only ever
    name a sandbox."""
    if not _SANDBOX_ID.fullmatch(sandbox_id):
        raise InvalidArgument(
            "sandbox_id", "must be 1-100 of [A-Za-z0-9_-], starting alphanumeric", sandbox_id
        )
    return sandbox_id


def _error(resp: httpx.Response, body: bytes) -> CorralError:
    try:
        doc = json.loads(body)
        return error_from_wire(doc["error"], resp.status_code)
    except (ValueError, KeyError, TypeError):
        text = body[:300].decode(errors="replace")
        return InternalError(f"HTTP {resp.status_code} from {resp.url}: {text}")


class HttpService:
    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`transport` replaces the network (tests pass httpx.ASGITransport)."""
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        base = url.rstrip("/")
        if transport is None and url.startswith("unix:"):
            transport = httpx.AsyncHTTPTransport(uds=url.removeprefix("unix:"))
            base = "http://corral"
        self.url = url
        self._http = httpx.AsyncClient(
            base_url=base,
            transport=transport or httpx.AsyncHTTPTransport(),
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=10.0),
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            resp = await self._http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise Unavailable(
                f"Corral server at {self.url} unreachable: {exc}", retry=True
            ) from exc
        if resp.status_code >= 400:
            raise _error(resp, resp.content)
        return resp

    async def create(self, req: CreateSandbox) -> SandboxInfo:
        resp = await self._call(
            "POST",
            "/v1/sandboxes",
            content=req.model_dump_json(),
            headers={"content-type": "application/json"},
        )
        return SandboxInfo.model_validate_json(resp.content)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        resp = await self._call("GET", f"/v1/sandboxes/{_sid(sandbox_id)}")
        return SandboxInfo.model_validate_json(resp.content)

    async def list(self, labels: dict[str, str] | None = None) -> builtins.list[SandboxInfo]:
        params = [("label", f"{k}={v}") for k, v in (labels or {}).items()]
        resp = await self._call("GET", "/v1/sandboxes", params=params)
        return [SandboxInfo.model_validate(s) for s in resp.json()["sandboxes"]]

    async def close(self, sandbox_id: str) -> None:
        await self._call("DELETE", f"/v1/sandboxes/{_sid(sandbox_id)}")

    async def exec(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        try:
            async with self._http.stream(
                "POST",
                f"/v1/sandboxes/{_sid(sandbox_id)}/exec",
                content=req.model_dump_json(),
                headers={"content-type": "application/json"},
                timeout=httpx.Timeout(None, connect=10.0),
            ) as resp:
                if resp.status_code >= 400:
                    raise _error(resp, await resp.aread())
                async for line in resp.aiter_lines():
                    if not line:
                        continue
                    doc = json.loads(line)
                    kind = doc.get("type")
                    if kind == "started":
                        yield ExecStarted.model_validate(doc)
                    elif kind in ("stdout", "stderr"):
                        yield ExecOutput.model_validate_json(line)
                    elif kind == "exit":
                        yield ExecExit.model_validate(doc)
                        return
                    elif kind == "error":
                        raise error_from_wire(doc["error"])
        except httpx.TransportError as exc:
            raise Unavailable(
                f"Corral server at {self.url} unreachable: {exc}", retry=True
            ) from exc

    async def kill(self, sandbox_id: str, pid: int, signal: int = 9) -> None:
        await self._call(
            "POST",
            f"/v1/sandboxes/{_sid(sandbox_id)}/commands/{pid}/kill",
            params={"signal": signal},
        )

    async def read_file(self, sandbox_id: str, path: str, user: str = "root") -> bytes:
        resp = await self._call(
            "GET", f"/v1/sandboxes/{_sid(sandbox_id)}/files", params={"path": path, "user": user}
        )
        return resp.content

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes, user: str = "root", mode: int = 0o644
    ) -> int:
        resp = await self._call(
            "PUT",
            f"/v1/sandboxes/{_sid(sandbox_id)}/files",
            params={"path": path, "user": user, "mode": mode},
            content=data,
        )
        return int(resp.json()["bytes"])

    async def list_files(
        self, sandbox_id: str, path: str, user: str = "root"
    ) -> builtins.list[FileEntry]:
        resp = await self._call(
            "GET",
            f"/v1/sandboxes/{_sid(sandbox_id)}/files/list",
            params={"path": path, "user": user},
        )
        return [FileEntry.model_validate(e) for e in resp.json()["entries"]]

    async def stat_file(self, sandbox_id: str, path: str, user: str = "root") -> FileEntry:
        resp = await self._call(
            "GET",
            f"/v1/sandboxes/{_sid(sandbox_id)}/files/stat",
            params={"path": path, "user": user},
        )
        return FileEntry.model_validate_json(resp.content)

    async def make_dir(self, sandbox_id: str, path: str, user: str = "root") -> None:
        await self._call(
            "POST",
            f"/v1/sandboxes/{_sid(sandbox_id)}/files/mkdir",
            params={"path": path, "user": user},
        )

    async def remove_file(
        self, sandbox_id: str, path: str, user: str = "root", recursive: bool = True
    ) -> None:
        await self._call(
            "DELETE",
            f"/v1/sandboxes/{_sid(sandbox_id)}/files",
            params={"path": path, "user": user, "recursive": recursive},
        )

    async def upload_tar(self, sandbox_id: str, path: str, data: bytes) -> None:
        await self._call(
            "PUT", f"/v1/sandboxes/{_sid(sandbox_id)}/tar", params={"path": path}, content=data
        )

    async def download_tar(self, sandbox_id: str, path: str) -> bytes:
        resp = await self._call(
            "GET", f"/v1/sandboxes/{_sid(sandbox_id)}/tar", params={"path": path}
        )
        return resp.content

    async def commit(self, sandbox_id: str, req: CommitRequest) -> LayerInfo:
        resp = await self._call(
            "POST",
            f"/v1/sandboxes/{_sid(sandbox_id)}/commit",
            content=req.model_dump_json(),
            headers={"content-type": "application/json"},
        )
        return LayerInfo.model_validate_json(resp.content)

    async def run_call(self, req: FnCallRequest) -> FnCallResult:
        resp = await self._call(
            "POST",
            "/v1/fncall",
            content=req.model_dump_json(),
            headers={"content-type": "application/json"},
        )
        return FnCallResult.model_validate_json(resp.content)

    async def suspend(self, sandbox_id: str) -> SandboxInfo:
        resp = await self._call("POST", f"/v1/sandboxes/{_sid(sandbox_id)}/suspend")
        return SandboxInfo.model_validate_json(resp.content)

    async def save(self, sandbox_id: str, req: SaveRequest) -> SavedState:
        resp = await self._call(
            "POST", f"/v1/sandboxes/{_sid(sandbox_id)}/save", json=req.model_dump()
        )
        return SavedState.model_validate(resp.json())

    async def restore(self, req: SavedState) -> SandboxInfo:
        resp = await self._call("POST", "/v1/restore", json=req.model_dump(exclude_none=True))
        return SandboxInfo.model_validate(resp.json())

    async def fork(self, sandbox_id: str, req: ForkRequest) -> builtins.list[SandboxInfo]:
        resp = await self._call(
            "POST",
            f"/v1/sandboxes/{_sid(sandbox_id)}/fork",
            json=req.model_dump(exclude_none=True),
        )
        return [SandboxInfo.model_validate(x) for x in resp.json()]

    async def screenshot(self, sandbox_id: str) -> bytes:
        resp = await self._call("GET", f"/v1/sandboxes/{_sid(sandbox_id)}/display/screenshot")
        return resp.content

    async def display_input(self, sandbox_id: str, req: DisplayInput) -> None:
        await self._call(
            "POST",
            f"/v1/sandboxes/{_sid(sandbox_id)}/display/input",
            json=req.model_dump(exclude_none=True),
        )

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        resp = await self._call("POST", f"/v1/sandboxes/{_sid(sandbox_id)}/resume")
        return SandboxInfo.model_validate_json(resp.content)

    async def audit(self, sandbox_id: str) -> AuditReport:
        resp = await self._call("GET", f"/v1/sandboxes/{_sid(sandbox_id)}/audit")
        return AuditReport.model_validate_json(resp.content)

    async def update_network(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo:
        resp = await self._call(
            "PUT",
            f"/v1/sandboxes/{_sid(sandbox_id)}/network",
            content=policy.model_dump_json(),
            headers={"content-type": "application/json"},
        )
        return SandboxInfo.model_validate_json(resp.content)
