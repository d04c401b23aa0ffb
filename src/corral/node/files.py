"""File operations in a sandbox, served by its exec server (which runs them
as the user asked for, inside the sandbox's namespaces), and tar upload and
download through the platform's own busybox (never the image's tar)."""

from __future__ import annotations

import builtins
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager

from corral import metrics
from corral.api.models import FileEntry, XattrRequest, check_path
from corral.config import NodeConfig
from corral.errors import FileError, InvalidArgument
from corral.execd import protocol as proto
from corral.execd.client import ExecdClient
from corral.host import platform as plat
from corral.node.sessions import Sessions
from corral.node.store import SandboxRecord

Awake = Callable[[str], Awaitable[SandboxRecord]]


def as_user(rec: SandboxRecord, user: str) -> str:
    """Who a file operation runs as: the user the caller named, else the
    sandbox's default user (its image's, as its commands), else root. Never
    root by default where the image says otherwise: the platform acting for
    a trainer must not do what the sandbox's own user could not."""
    return user or rec.image_user or "root"


def _entry(e: proto.Entry, path: str) -> FileEntry:
    kinds = {"f": "file", "d": "dir", "l": "symlink"}
    return FileEntry(
        name=e.name.rsplit("/", 1)[-1] or "/",
        path=path,
        type=kinds.get(e.kind, "other"),  # type: ignore[arg-type]
        size=e.size,
        mode=e.mode & 0o7777,
        mtime=e.mtime_ns / 1e9,
        uid=e.uid,
        gid=e.gid,
        target=e.target,
        xattrs=e.xattrs or {},
    )


class Files:
    """Every operation checks its arguments, then wakes the sandbox (a
    suspended one is resumed), then acts: a bad request never resumes."""

    def __init__(
        self,
        config: NodeConfig,
        awake: Awake,
        execd: Callable[[str], ExecdClient],
        sessions: Sessions,
    ) -> None:
        self.max_bytes = config.max_file_bytes
        self._awake = awake
        self._execd = execd
        self.sessions = sessions

    @contextmanager
    def _audited(self, sandbox_id: str) -> Iterator[None]:
        """An answer the host refused to hold (execd/client.py) is counted."""
        try:
            yield
        except FileError as exc:
            if exc.details.get("refused") == "reply":
                self.sessions.store.count(sandbox_id, "replies_refused")
            raise

    async def read(self, sandbox_id: str, path: str, user: str, follow: bool = True) -> bytes:
        path = check_path(path)
        rec = await self._awake(sandbox_id)
        metrics.FILE_OPS.labels("read").inc()
        with self._audited(sandbox_id):
            return await self._execd(sandbox_id).read(
                as_user(rec, user), path, self.max_bytes, nofollow=not follow
            )

    async def write(
        self, sandbox_id: str, path: str, data: bytes, user: str, mode: int, follow: bool = True
    ) -> int:
        path = check_path(path)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgument("data", "must be bytes", type(data).__name__)
        if len(data) > self.max_bytes:
            raise InvalidArgument("data", f"must be at most {self.max_bytes} bytes per file", data)
        if not 0 <= mode <= 0o7777:
            raise InvalidArgument("mode", "must be a permission mode between 0 and 0o7777", mode)
        rec = await self._awake(sandbox_id)
        metrics.FILE_OPS.labels("write").inc()
        return await self._execd(sandbox_id).write(
            as_user(rec, user), path, bytes(data), mode=mode, max_bytes=self.max_bytes,
            nofollow=not follow,
        )  # fmt: skip

    async def list(self, sandbox_id: str, path: str, user: str) -> builtins.list[FileEntry]:
        path = check_path(path)
        rec = await self._awake(sandbox_id)
        metrics.FILE_OPS.labels("list").inc()
        with self._audited(sandbox_id):
            entries = await self._execd(sandbox_id).list(as_user(rec, user), path)
        return sorted(
            (_entry(e, f"{path.rstrip('/')}/{e.name}") for e in entries), key=lambda e: e.name
        )

    async def stat(self, sandbox_id: str, path: str, user: str) -> FileEntry:
        path = check_path(path)
        rec = await self._awake(sandbox_id)
        return _entry(await self._execd(sandbox_id).stat(as_user(rec, user), path), path)

    async def make_dir(self, sandbox_id: str, path: str, user: str) -> None:
        path = check_path(path)
        rec = await self._awake(sandbox_id)
        await self._execd(sandbox_id).mkdir(as_user(rec, user), path)

    async def set_xattrs(self, sandbox_id: str, req: XattrRequest) -> None:
        path = check_path(req.path)
        rec = await self._awake(sandbox_id)
        metrics.FILE_OPS.labels("xattr").inc()
        await self._execd(sandbox_id).set_xattrs(
            as_user(rec, req.user), path, req.clear, req.values
        )

    async def remove(self, sandbox_id: str, path: str, user: str, recursive: bool) -> None:
        path = check_path(path)
        if path == "/":
            raise InvalidArgument("path", "must not be the sandbox's root", path)
        rec = await self._awake(sandbox_id)
        metrics.FILE_OPS.labels("remove").inc()
        await self._execd(sandbox_id).remove(as_user(rec, user), path, recursive=recursive)

    async def upload_tar(self, sandbox_id: str, path: str, data: bytes) -> None:
        path = check_path(path)
        if len(data) > self.max_bytes:
            raise InvalidArgument("data", f"must be at most {self.max_bytes} bytes", data)
        await self.make_dir(sandbox_id, path, "")
        metrics.FILE_OPS.labels("upload_tar").inc()
        await self.sessions.run_platform(
            await self._awake(sandbox_id),
            [plat.BUSYBOX, "tar", "-x", "-C", path],
            bytes(data),
            f"extracting a tar into {path}",
        )

    async def download_tar(self, sandbox_id: str, path: str) -> bytes:
        path = check_path(path)
        metrics.FILE_OPS.labels("download_tar").inc()
        return await self.sessions.run_platform(
            await self._awake(sandbox_id),
            [plat.BUSYBOX, "tar", "-c", "-C", path, "."],
            None,
            f"archiving {path}",
        )
