"""The HTTP API and the SDK's HTTP transport, end to end in memory.

FakeService is a transport seam (no sandboxes run here); the integration
tests drive the same API against real sandboxes."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

import corral
from corral.api.app import create_app
from corral.api.http import HttpService
from corral.api.models import (
    App,
    AuditReport,
    CommitRequest,
    CreateSandbox,
    DisplayInput,
    DisplayState,
    ExecEvent,
    ExecExit,
    ExecOutput,
    ExecRequest,
    ExecStarted,
    FileEntry,
    FnCallRequest,
    FnCallResult,
    ForkRequest,
    LaunchRequest,
    LayerInfo,
    NetworkPolicy,
    SandboxInfo,
    SandboxState,
    SavedState,
    SaveRequest,
    Window,
)
from corral.errors import SandboxNotFound


class FakeService:
    def __init__(self) -> None:
        self.boxes: dict[str, SandboxInfo] = {}
        self.files: dict[str, bytes] = {}
        self.calls: list[tuple[Any, ...]] = []  # what arrived, after the wire
        self.starts = 0

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
        if req.cmd == "fail midway":
            raise corral.SandboxFailed("the sandbox died", sandbox=sandbox_id)
        yield ExecOutput(type="stderr", data="é".encode())
        yield ExecExit(exit_code=3, stdout_bytes=2, stderr_bytes=2)

    async def kill(self, sandbox_id: str, pid: int, signal: int = 9) -> None:
        await self.get(sandbox_id)
        self.calls.append(("kill", sandbox_id, pid, signal))

    async def read_file(
        self, sandbox_id: str, path: str, user: str = "", follow_symlinks: bool = True
    ) -> bytes:
        if path not in self.files:
            raise corral.FileNotFound(f"{path}: No such file or directory", path=path)
        return self.files[path]

    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        data: bytes,
        user: str = "",
        mode: int = 0o644,
        follow_symlinks: bool = True,
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
        self.calls.append(("remove_file", sandbox_id, path, user, recursive))
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

    async def suspend(self, sandbox_id: str) -> SandboxInfo:
        info = await self.get(sandbox_id)
        return info.model_copy(update={"state": SandboxState.suspended})

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        return await self.get(sandbox_id)

    async def update_network(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo:
        info = await self.get(sandbox_id)
        return info.model_copy(update={"network": policy})

    async def fork(self, sandbox_id: str, req: ForkRequest) -> list[SandboxInfo]:
        self.calls.append(("fork", sandbox_id, req))
        return [await self.get(sandbox_id)] * req.n

    async def save(self, sandbox_id: str, req: SaveRequest) -> SavedState:
        return SavedState(store=req.store, key="vmstates/fake-00000000000000aa", sandbox=sandbox_id)

    async def restore(self, req: SavedState) -> SandboxInfo:
        self.calls.append(("restore", req))
        return await self.create(CreateSandbox(image="img:1"))

    async def screenshot(
        self, sandbox_id: str, percent: int = 100, x: int = 0, y: int = 0, width: int = 0,
        height: int = 0,
    ) -> bytes:  # fmt: skip
        self.calls.append(("screenshot", sandbox_id, (percent, x, y, width, height)))
        return b"\x89PNG"

    async def display_state(self, sandbox_id: str) -> DisplayState:
        return DisplayState(width=1024, height=768, cursor_x=1, cursor_y=2)

    async def display_windows(self, sandbox_id: str) -> list[Window]:
        return [Window(id="0x1", title="t", x=0, y=0, width=1, height=1)]

    async def display_apps(self, sandbox_id: str) -> list[App]:
        return [App(id="a", name="A", command="a")]

    async def display_launch(self, sandbox_id: str, req: LaunchRequest) -> App:
        return App(id=req.app, name=req.app, command=req.app)

    async def display_input(self, sandbox_id: str, req: DisplayInput) -> None:
        self.calls.append(("display_input", sandbox_id, req))

    async def run_call(self, req: FnCallRequest) -> FnCallResult:
        return FnCallResult(
            status="ok",
            exit_code=0,
            stdout="1\n",
            stderr="",
            wall_time=0.5,
            cpu_time=0.25,
            peak_memory=1,
            files={k: v[::-1] for k, v in req.files.items()},
        )

    async def start(self) -> None:
        self.starts += 1

    async def aclose(self) -> None:
        pass


def _client(api_key: str | None = None, server_key: str | None = None) -> corral.AsyncClient:
    app = create_app(FakeService(), api_key=server_key)
    http = HttpService("http://test", api_key=api_key, transport=httpx.ASGITransport(app=app))
    return corral.AsyncClient(transport=http)


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


class Recording(httpx.AsyncBaseTransport):
    """The app's transport, keeping each exchange as it crossed the wire."""

    def __init__(self, app: Any) -> None:
        self.inner = httpx.ASGITransport(app=app)
        self.seen: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        resp = await self.inner.handle_async_request(request)
        content = await resp.aread()
        self.seen.append(
            {
                "request": f"{request.method} {request.url.raw_path.decode()}",
                "type": request.headers.get("content-type"),
                "body": body,
                "status": resp.status_code,
                "reply_type": resp.headers.get("content-type"),
                "reply": content,
            }
        )
        return httpx.Response(resp.status_code, headers=resp.headers, content=content)


async def test_the_wire_is_what_clients_already_speak() -> None:
    """Paths, verbs, query names, bodies and statuses, byte for byte, as
    they were before the route table: clients of older releases and other
    languages depend on them."""
    fake = FakeService()
    fake.files["/a b"] = b"\x00"
    wire = Recording(create_app(fake))
    svc = HttpService("http://t", transport=wire)
    made = await svc.create(CreateSandbox(image="img:1", labels={"job": "a=b"}))
    sid = made.id
    await svc.list({"job": "a=b"})
    await svc.kill(sid, 42, 15)
    await svc.read_file(sid, "/a b", "nobody")
    assert await svc.write_file(sid, "/w", b"\x00\xff", mode=0o600) == 2
    await svc.remove_file(sid, "/w", recursive=False)
    events = [e async for e in svc.exec(sid, ExecRequest(cmd="x", stdin=b"in"))]
    assert [e.type for e in events] == ["started", "stdout", "stderr", "exit"]
    await svc.fork(sid, ForkRequest(n=2))
    await svc.restore(SavedState(store="local", key="vmstates/fake-00000000000000aa"))
    await svc.display_input(sid, DisplayInput(action="type", text="hi"))
    assert await svc.screenshot(sid) == b"\x89PNG"
    assert await svc.screenshot(sid, 50, 1, 2, 30, 40) == b"\x89PNG"
    assert (await svc.display_state(sid)).cursor_y == 2
    assert [w.title for w in await svc.display_windows(sid)] == ["t"]
    assert [a.id for a in await svc.display_apps(sid)] == ["a"]
    assert (await svc.display_launch(sid, LaunchRequest(app="xterm"))).id == "xterm"
    result = await svc.run_call(FnCallRequest(language="python", code="1", files={"f": b"ab"}))
    assert result.files == {"f": b"ba"}
    with pytest.raises(corral.SandboxNotFound):
        await svc.get("fake-99")
    await svc.aclose()

    by_request = {(x["request"].split("?")[0], x["status"]): x for x in wire.seen}
    create = wire.seen[0]
    assert (create["request"], create["status"]) == ("POST /v1/sandboxes", 201)
    assert create["type"] == "application/json"
    sent = json.loads(create["body"])
    assert sent["labels"] == {"job": "a=b"} and sent["idempotency_key"] is None  # all fields
    assert json.loads(create["reply"])["id"] == sid
    exchanges = [(x["request"], x["status"], x["reply_type"]) for x in wire.seen[1:]]
    assert exchanges == [
        ("GET /v1/sandboxes?label=job%3Da%3Db", 200, "application/json"),
        (f"POST /v1/sandboxes/{sid}/commands/42/kill?signal=15", 204, None),
        # follow_symlinks came later (issue 14): a server that predates it
        # ignores it, and one that has it defaults to true when it is absent.
        (
            f"GET /v1/sandboxes/{sid}/files?path=%2Fa+b&user=nobody&follow_symlinks=true",
            200,
            "application/octet-stream",
        ),
        (
            # user= (empty): the sandbox's default user, no longer root (issue 14)
            f"PUT /v1/sandboxes/{sid}/files?path=%2Fw&user=&mode=384&follow_symlinks=true",
            200,
            "application/json",
        ),
        (f"DELETE /v1/sandboxes/{sid}/files?path=%2Fw&user=&recursive=false", 204, None),
        (f"POST /v1/sandboxes/{sid}/exec", 200, "application/x-ndjson"),
        (f"POST /v1/sandboxes/{sid}/fork", 200, "application/json"),
        ("POST /v1/restore", 200, "application/json"),
        (f"POST /v1/sandboxes/{sid}/display/input", 204, None),
        (
            f"GET /v1/sandboxes/{sid}/display/screenshot?percent=100&x=0&y=0&width=0&height=0",
            200,
            "image/png",
        ),
        (
            f"GET /v1/sandboxes/{sid}/display/screenshot?percent=50&x=1&y=2&width=30&height=40",
            200,
            "image/png",
        ),
        (f"GET /v1/sandboxes/{sid}/display", 200, "application/json"),
        (f"GET /v1/sandboxes/{sid}/display/windows", 200, "application/json"),
        (f"GET /v1/sandboxes/{sid}/display/apps", 200, "application/json"),
        (f"POST /v1/sandboxes/{sid}/display/launch", 200, "application/json"),
        ("POST /v1/fncall", 200, "application/json"),
        ("GET /v1/sandboxes/fake-99", 404, "application/json"),
    ]
    assert json.loads(wire.seen[1]["reply"])["sandboxes"][0]["id"] == sid
    assert wire.seen[4]["body"] == b"\x00\xff" and wire.seen[4]["reply"] == b'{"bytes":2}'
    assert all(x["reply"] == b"" for x in wire.seen if x["status"] == 204)
    lines = [json.loads(line) for line in wire.seen[6]["reply"].splitlines()]
    assert lines[0] == {"type": "started", "pid": 7}
    assert lines[1] == {"type": "stdout", "data": "_wBpbg=="}  # URL-safe base64 of ff 00 "in"
    assert json.loads(wire.seen[6]["body"])["stdin"] == "aW4="  # base64
    assert [x["type"] for x in lines] == ["started", "stdout", "stderr", "exit"]
    fork = by_request[(f"POST /v1/sandboxes/{sid}/fork", 200)]
    assert json.loads(fork["body"]) == {"n": 2}  # None fields left out
    assert isinstance(json.loads(fork["reply"]), list)  # a bare list
    restore = by_request[("POST /v1/restore", 200)]
    assert "idempotency_key" not in json.loads(restore["body"])
    display = by_request[(f"POST /v1/sandboxes/{sid}/display/input", 204)]
    assert json.loads(display["body"]) == {
        "action": "type",
        "button": "left",
        "count": 1,
        "dx": 0,
        "dy": 0,
        "text": "hi",
    }
    fncall = by_request[("POST /v1/fncall", 200)]
    assert json.loads(fncall["body"])["files"] == {"f": "YWI="}
    assert json.loads(fncall["reply"])["files"] == {"f": "YmE="}
    missing = json.loads(by_request[("GET /v1/sandboxes/fake-99", 404)]["reply"])
    assert missing == {
        "error": {
            "code": "sandbox_not_found",
            "message": "no sandbox 'fake-99'",
            "sandbox": "fake-99",
        }
    }
    # What the service was handed is what the caller passed.
    assert ("kill", sid, 42, 15) in fake.calls
    assert ("remove_file", sid, "/w", "", False) in fake.calls
    assert ("fork", sid, ForkRequest(n=2)) in fake.calls


async def test_an_error_before_a_command_starts_is_a_plain_http_error() -> None:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=create_app(FakeService())), base_url="http://t"
    ) as h:
        resp = await h.post("/v1/sandboxes/fake-9/exec", json={"cmd": "x"})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "sandbox_not_found"


async def test_an_error_after_a_command_starts_ends_its_stream() -> None:
    async with _client() as client:
        sbx = await client.sandboxes.create(image="img:1")
        seen: list[str] = []
        with pytest.raises(corral.SandboxFailed, match="the sandbox died"):
            await sbx.commands.run("fail midway", on_stdout=seen.append)
        assert seen == ["\ufffd\x00"]


async def test_a_client_starts_the_service_it_is_given_once() -> None:
    fake = FakeService()
    async with corral.AsyncClient(transport=fake) as client:
        sbx = await client.sandboxes.create(image="img:1")
        await client.sandboxes.get(sbx.id)
        assert (await client.fncall.run("python", "1")).stdout == "1\n"
        assert client.service is fake
    assert fake.starts == 1


async def test_sandboxfusion_endpoints_tell_a_platform_failure_from_bad_input() -> None:
    """The platform failing is SandboxFusion's SandboxError (a 200, as its
    clients expect); bad input stays a 400 that names the field."""
    from corral.errors import Unavailable

    class Failing(FakeService):
        async def run_call(self, req: FnCallRequest) -> FnCallResult:
            raise Unavailable("no function-call worker became free in 120s")

    app = create_app(Failing())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
        for path, body in (
            ("/run_code", {"language": "python", "code": "print(1)"}),
            ("/run_jupyter", {"cells": ["print(1)"]}),
        ):
            r = await h.post(path, json=body)
            assert r.status_code == 200 and r.json()["status"] == "SandboxError", r.text
            assert "no function-call worker" in r.json()["message"]
        r = await h.post("/run_jupyter", json={"cells": ["1"], "total_timeout": -1})
        assert r.status_code == 400 and r.json()["error"]["field"] == "total_timeout"


async def test_a_body_past_its_bound_is_refused_before_it_is_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FastAPI reads a model's whole body before validating it; uvicorn
    bounds nothing. A body past its bound is refused by its declared
    length, or as it arrives when it declares none (chunked), and the
    service never sees the request."""
    from corral.api import serving

    monkeypatch.setattr(serving, "MAX_JSON_BODY", 10_000)
    monkeypatch.setattr(serving, "MAX_ANY_BODY", 20_000)
    svc = FakeService()
    app = create_app(svc)
    big = json.dumps({"image": "img:1", "labels": {"k": "v" * 15_000}}).encode()

    async def chunked(data: bytes) -> AsyncIterator[bytes]:
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
        resp = await h.post("/v1/sandboxes", content=big,
                            headers={"content-type": "application/json"})  # fmt: skip
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["field"] == "body"
        assert "at most 10000 bytes" in resp.json()["error"]["message"]
        resp = await h.post("/v1/sandboxes", content=chunked(big),
                            headers={"content-type": "application/json"})  # fmt: skip
        assert resp.status_code == 400 and "at most 10000 bytes" in resp.text, resp.text
        # Not JSON: the larger bound (a file's); a raw route keeps its own.
        resp = await h.post("/v1/sandboxes", content=chunked(b"x" * 30_000),
                            headers={"content-type": "application/octet-stream"})  # fmt: skip
        assert resp.status_code == 400 and "at most 20000 bytes" in resp.text, resp.text
        assert svc.boxes == {}
        ok = await h.post("/v1/sandboxes", json={"image": "img:1"})
        assert ok.status_code == 201, ok.text
