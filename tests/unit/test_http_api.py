"""The HTTP API and the SDK's HTTP transport, end to end in memory.

FakeService is a transport seam (no sandboxes run here); the integration
tests drive the same API against real sandboxes."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import httpx
import pytest

import corral
from corral.api.app import create_app
from corral.api.models import (
    AuditReport,
    CommitRequest,
    CreateSandbox,
    ExecEvent,
    ExecExit,
    ExecOutput,
    ExecRequest,
    ExecStarted,
    FileEntry,
    LayerInfo,
    SandboxInfo,
    SandboxState,
)
from corral.errors import SandboxNotFound
from corral.sdk.http import HttpService


class FakeService:
    def __init__(self) -> None:
        self.boxes: dict[str, SandboxInfo] = {}
        self.files: dict[str, bytes] = {}

    async def create(self, req: CreateSandbox) -> SandboxInfo:
        sid = f"fake-{len(self.boxes)}"
        info = SandboxInfo(
            id=sid,
            node="fake",
            kind=req.kind,
            state=SandboxState.running,
            image=req.image,
            workspace=req.workspace,
            toolkit=req.toolkit,
            layers=[],
            cpu=req.cpu,
            memory=req.memory,
            disk=req.disk,
            pids=req.pids,
            ttl=req.ttl,
            idle_timeout=req.idle_timeout,
            env=req.env,
            labels=req.labels,
            created_at=time.time(),
            expires_at=None,
        )
        self.boxes[sid] = info
        return info

    async def get(self, sandbox_id: str) -> SandboxInfo:
        if sandbox_id not in self.boxes:
            raise SandboxNotFound(f"no sandbox {sandbox_id!r}", sandbox=sandbox_id)
        return self.boxes[sandbox_id]

    async def list(self, labels: dict[str, str] | None = None) -> list[SandboxInfo]:
        return [
            b
            for b in self.boxes.values()
            if all(b.labels.get(k) == v for k, v in (labels or {}).items())
        ]

    async def close(self, sandbox_id: str) -> None:
        await self.get(sandbox_id)

    async def exec(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        await self.get(sandbox_id)
        yield ExecStarted(pid=7)
        yield ExecOutput(type="stdout", data=b"\xff\x00" + (req.stdin or b""))
        yield ExecOutput(type="stderr", data="é".encode())
        yield ExecExit(exit_code=3, stdout_bytes=2, stderr_bytes=2)

    async def kill(self, sandbox_id: str, pid: int, signal: int = 9) -> None:
        await self.get(sandbox_id)

    async def read_file(self, sandbox_id: str, path: str, user: str = "root") -> bytes:
        if path not in self.files:
            raise corral.FileNotFound(f"{path}: No such file or directory", path=path)
        return self.files[path]

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes, user: str = "root", mode: int = 0o644
    ) -> int:
        self.files[path] = data
        return len(data)

    async def list_files(self, sandbox_id: str, path: str, user: str = "root") -> list[FileEntry]:
        return [
            FileEntry(
                name=p.rsplit("/", 1)[1], path=p, type="file", size=len(d), mode=0o644, mtime=0.0
            )
            for p, d in self.files.items()
        ]

    async def stat_file(self, sandbox_id: str, path: str, user: str = "root") -> FileEntry:
        return (await self.list_files(sandbox_id, path))[0]

    async def make_dir(self, sandbox_id: str, path: str, user: str = "root") -> None:
        pass

    async def remove_file(
        self, sandbox_id: str, path: str, user: str = "root", recursive: bool = True
    ) -> None:
        self.files.pop(path, None)

    async def upload_tar(self, sandbox_id: str, path: str, data: bytes) -> None:
        self.files[path + "/tar"] = data

    async def download_tar(self, sandbox_id: str, path: str) -> bytes:
        return self.files[path + "/tar"]

    async def commit(self, sandbox_id: str, req: CommitRequest) -> LayerInfo:
        await self.get(sandbox_id)
        return LayerInfo(
            digest="sha256:" + "0" * 64,
            names=[req.tag],
            kind=req.kind,
            parent=None,
            content_size=1,
            meta_size=1,
            blob_size=1,
            chunk_size=65536,
            created=0.0,
        )

    async def audit(self, sandbox_id: str) -> AuditReport:
        await self.get(sandbox_id)
        return AuditReport(sandbox=sandbox_id, syscalls_denied={"privileged": 2})

    async def aclose(self) -> None:
        pass


def _client(api_key: str | None = None, server_key: str | None = None) -> corral.AsyncClient:
    app = create_app(FakeService(), api_key=server_key)
    client = corral.AsyncClient("http://test", api_key=api_key)
    client._service = HttpService(
        "http://test", api_key=api_key, transport=httpx.ASGITransport(app=app)
    )
    return client


async def test_sdk_over_http_round_trip() -> None:
    async with _client() as client:
        sbx = await client.sandboxes.create(image="img:1", memory="64MiB", labels={"job": "j"})
        assert sbx.info.memory == 64 * 2**20
        again = await client.sandboxes.get(sbx.id)
        assert again.info.labels == {"job": "j"}
        assert [s.id for s in await client.sandboxes.list({"job": "j"})] == [sbx.id]
        assert await client.sandboxes.list({"job": "other"}) == []
        seen: list[str] = []
        r = await sbx.commands.run("x", stdin=b"in", on_stdout=seen.append)
        assert r.exit_code == 3 and r.stderr == "é" and r.pid == 7
        assert r.stdout == "\ufffd\x00in" and seen == ["\ufffd\x00in"]
        await sbx.files.write("/w/a.txt", "hi")
        assert await sbx.files.read("/w/a.txt") == b"hi"
        assert [e.name for e in await sbx.files.list("/w")] == ["a.txt"]
        assert (await sbx.audit()).syscalls_denied == {"privileged": 2}
        layer = await sbx.commit("mine:1", kind="toolkit")
        assert layer.names == ["mine:1"] and layer.kind == "toolkit"
        await sbx.files.upload_tar("/t", b"TAR")
        assert await sbx.files.download_tar("/t") == b"TAR"
        await sbx.close()


async def test_errors_cross_http_as_the_same_classes() -> None:
    async with _client() as client:
        with pytest.raises(corral.SandboxNotFound):
            await client.sandboxes.get("fake-99")
        sbx = await client.sandboxes.create(image="img:1")
        with pytest.raises(corral.FileNotFound) as exc:
            await sbx.files.read("/missing")
        assert isinstance(exc.value, FileNotFoundError)


async def test_server_side_validation_names_the_field() -> None:
    app = create_app(FakeService())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
        resp = await h.post("/v1/sandboxes", json={"image": "img:1", "memory": "lots"})
        assert resp.status_code == 400
        err = resp.json()["error"]
        assert err["code"] == "invalid_argument" and err["field"] == "memory"
        assert err["value"] == "'lots'"
        resp = await h.post("/v1/sandboxes", json={"image": "img:1", "bogus": 1})
        assert resp.json()["error"]["field"] == "bogus"


async def test_api_key_is_required_when_configured() -> None:
    async with _client(api_key=None, server_key="s3cret") as client:
        with pytest.raises(corral.Unauthenticated):
            await client.sandboxes.list()
    async with _client(api_key="wrong", server_key="s3cret") as client:
        with pytest.raises(corral.Unauthenticated):
            await client.sandboxes.list()
    async with _client(api_key="s3cret", server_key="s3cret") as client:
        assert await client.sandboxes.list() == []


async def test_metrics_and_openapi_are_served() -> None:
    app = create_app(FakeService())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
        assert "corral_sandboxes_created_total" in (await h.get("/metrics")).text
        spec = (await h.get("/openapi.json")).json()
        assert "/v1/sandboxes/{sandbox_id}/exec" in spec["paths"]


@pytest.mark.parametrize(
    "sid", ["..", ".", "a/b", "a?x=1", "", "x" * 101, "-lead", "a b", "%2e%2e", "ü"]
)
async def test_ids_that_are_not_a_path_segment_are_refused_before_sending(sid: str) -> None:
    async with _client() as client:
        for call in (client.sandboxes.get(sid), _read_through_service(client, sid)):
            with pytest.raises(corral.InvalidArgument) as err:
                await call
            assert err.value.field == "sandbox_id"


async def _read_through_service(client: corral.AsyncClient, sid: str) -> None:
    await client.service.read_file(sid, "/etc/passwd")  # past the SDK's sandbox handle


async def test_an_unknown_route_is_a_wire_error_not_a_bare_404() -> None:
    app = create_app(FakeService())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
        resp = await h.get("/v1/nothing/here")
        assert resp.status_code == 404
        assert resp.json()["error"]["code"] == "not_found"
        assert "/v1/nothing/here" in resp.json()["error"]["message"]
        resp = await h.put("/v1/sandboxes")
        assert resp.status_code == 400 and resp.json()["error"]["field"] == "request"
