"""What the E2B adapter takes from a sandbox is bounded: a watcher's
stream (a process of the watching user can write to corral-watch's
stdout), the /etc/passwd and /etc/group it names owners from, and a
recursive listing's total. A scripted service plays the sandbox."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from starlette.requests import Request

from corral.api.compat.e2b import envd
from corral.api.compat.e2b import filesystem as fs
from corral.api.compat.e2b.connect import ConnectError
from corral.api.models import ExecExit, ExecOutput, ExecRequest, ExecStarted, FileEntry

pytestmark = pytest.mark.unit

Script = Callable[[ExecRequest], AsyncIterator[Any]]


def _dir(name: str, path: str) -> FileEntry:
    return FileEntry(name=name, path=path, type="dir", size=0, mode=0o755, mtime=0.0)


class Sandbox:
    """The parts of SandboxService the adapter calls here."""

    def __init__(self, script: Script, listing: int = 0) -> None:
        self.script = script
        self.listing = listing
        self.requests: list[ExecRequest] = []
        self.closed = 0

    async def exec(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[Any]:
        self.requests.append(req)
        try:
            async for ev in self.script(req):
                yield ev
        finally:
            self.closed += 1

    async def stat_file(self, sandbox_id: str, path: str, user: str) -> FileEntry:
        return _dir(path.rsplit("/", 1)[-1], path)

    async def list_files(self, sandbox_id: str, path: str, user: str) -> list[FileEntry]:
        base = path.rstrip("/")
        return [_dir(f"d{i}", f"{base}/d{i}") for i in range(self.listing)]


async def test_a_watcher_stream_with_no_record_end_is_ended_not_held() -> None:
    """Before, the bytes before a NUL were kept and re-split on every
    frame: 256 MiB held and ~quadratic copying. Now a record longer than
    corral-watch ever writes ends the watcher (and its process)."""
    sent = 0

    async def flood(req: ExecRequest) -> AsyncIterator[Any]:
        nonlocal sent
        yield ExecStarted(pid=9)
        yield ExecOutput(type="stdout", data=b"R\0")
        for _ in range(10_000):
            sent += 1
            yield ExecOutput(type="stdout", data=b"x" * 65536)
        yield ExecExit(exit_code=0)

    svc = Sandbox(flood)
    w = fs.Watcher(svc, "s", "/w", False, "user", fs.Names())  # type: ignore[arg-type]
    await w.start()
    assert w._task is not None
    async with asyncio.timeout(5):
        await w._task
    assert sent < 3 and svc.closed == 1
    assert await w.live.get() is None  # the stream ends


async def test_a_watchers_stderr_is_kept_to_4_kib() -> None:
    async def noisy(req: ExecRequest) -> AsyncIterator[Any]:
        for _ in range(1000):
            yield ExecOutput(type="stderr", data=b"e" * 4096)
        yield ExecExit(exit_code=4)

    w = fs.Watcher(Sandbox(noisy), "s", "/w", False, "user", fs.Names())  # type: ignore[arg-type]
    with pytest.raises(ConnectError) as e:
        await w.start()
    assert len(str(e.value)) < 5000


async def test_owner_names_read_at_most_4_mib_and_65536_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sandbox writes /etc/passwd: it is read through the platform's
    head, a bounded command, and at most NAMES_MAX names are kept."""
    monkeypatch.setattr(fs, "NAMES_MAX", 100)

    async def passwd(req: ExecRequest) -> AsyncIterator[Any]:
        lines = "".join(f"u{i}:x:{i}:{i}::/:/bin/sh\n" for i in range(10_000)).encode()
        yield ExecOutput(type="stdout", data=lines)
        yield ExecOutput(type="stdout", data=b"z" * (8 << 20))  # more than asked
        yield ExecExit(exit_code=0)

    svc = Sandbox(passwd)
    users, _groups = await fs.Names().of(svc, "s")  # type: ignore[arg-type]
    assert len(users) == 100 and users[0] == "u0"
    head = svc.requests[0]
    assert head.cmd[1:4] == ["head", "-c", str(fs.NAMES_FILE_MAX)]
    assert head.stdout_limit == fs.NAMES_FILE_MAX


async def test_a_deep_listing_past_its_total_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fs, "MAX_LISTED", 1000)

    async def none(req: ExecRequest) -> AsyncIterator[Any]:
        yield ExecExit(exit_code=0)

    svc = Sandbox(none, listing=20)  # 20 + 400 + 8000 at depth 3
    with pytest.raises(ConnectError, match="more than 1000 entries to depth 3"):
        await fs.Filesystem().list_dir(svc, "s", "/", 3, "user")  # type: ignore[arg-type]


def _upload_request(
    chunks: list[bytes], headers: dict[str, str], query: bytes = b"path=/f"
) -> Request:
    """A request whose body arrives in `chunks` (no length declared unless
    `headers` says one, as a chunked or HTTP/2 upload)."""
    scope = {
        "type": "http", "method": "POST", "path": "/files", "query_string": query,
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }  # fmt: skip
    sent = iter(chunks)

    async def receive() -> dict[str, Any]:
        chunk = next(sent, None)
        return {"type": "http.request", "body": chunk or b"", "more_body": chunk is not None}

    return Request(scope, receive)


def _multipart(files: int, size: int) -> tuple[list[bytes], dict[str, str]]:
    boundary = "b0undary"
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="f{i}"\r\n'
        f"Content-Type: application/octet-stream\r\n\r\n".encode()
        + b"x" * size
        + b"\r\n"
        for i in range(files)
    ]
    return [*parts, f"--{boundary}--\r\n".encode()], {
        "content-type": f"multipart/form-data; boundary={boundary}"
    }


UPLOADS = [
    ("raw, chunked", *([b"x" * 4096] * 64, {"content-type": "application/octet-stream"})),
    ("multipart files, chunked", *_multipart(16, 16384)),
    (
        "gzip bomb",
        [gzip.compress(b"\0" * (4 << 20))],
        {"content-type": "application/octet-stream", "content-encoding": "gzip"},
    ),
]


@pytest.mark.parametrize(("name", "chunks", "headers"), UPLOADS, ids=[u[0] for u in UPLOADS])
async def test_an_upload_past_its_bound_is_refused_whatever_it_declares(
    monkeypatch: pytest.MonkeyPatch, name: str, chunks: list[bytes], headers: dict[str, str]
) -> None:
    """Before: a multipart upload's files and a gzip body's inflation had
    no bound (Starlette bounds a form's text fields only), and a raw one
    was joined a chunk at a time, quadratically."""
    monkeypatch.setattr(envd, "MAX_UPLOAD", 100_000)
    e = envd.Envd(lambda sid: None)  # type: ignore[arg-type, return-value]
    with pytest.raises(ConnectError, match="uploads are at most 100000 bytes"):
        await e._uploaded(_upload_request(chunks, headers), "/home/user")


async def test_an_upload_within_its_bound_arrives_whole() -> None:
    e = envd.Envd(lambda sid: None)  # type: ignore[arg-type, return-value]
    chunks, headers = _multipart(2, 1000)
    got = await e._uploaded(_upload_request(chunks, headers, b""), "/home/user")
    assert [(p, len(d)) for p, d in got] == [("/home/user/f0", 1000), ("/home/user/f1", 1000)]
    zipped = {"content-type": "application/octet-stream", "content-encoding": "gzip"}
    got = await e._uploaded(_upload_request([gzip.compress(b"hello")], zipped), "/home/user")
    assert got == [("/f", b"hello")]


async def test_a_watcher_is_found_only_through_its_own_sandbox() -> None:
    """Watcher ids are the envd server's, not a sandbox's: a caller holding
    sandbox b's token must not read or stop sandbox a's watcher."""

    async def none(req: ExecRequest) -> AsyncIterator[Any]:
        yield ExecExit(exit_code=0)

    f = fs.Filesystem()
    w = fs.Watcher(Sandbox(none), "a", "/w", False, "user", f.names)  # type: ignore[arg-type]
    f.watchers[w.id] = w
    assert f.watcher("a", w.id) is w
    with pytest.raises(ConnectError, match="not found"):
        f.watcher("b", w.id)
    with pytest.raises(ConnectError, match="not found"):
        await f.remove_watcher("b", w.id)
    assert w.id in f.watchers
