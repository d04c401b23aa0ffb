"""Files in a sandbox. Paths are absolute, inside the sandbox; '..' is refused.

Every operation runs as `user` inside the sandbox: by default (``user=""``)
the sandbox's own default user (its image's, as its commands run), never
root unless that is the default. With ``follow_symlinks=False`` a read or
write refuses a symbolic link anywhere in the path (ELOOP): what a trainer
writes cannot be redirected by a link the agent planted."""

from __future__ import annotations

import builtins

from corral.api.models import FileEntry
from corral.api.service import SandboxService
from corral.errors import FileNotFound
from corral.sdk.handle import SandboxHandle


class AsyncFiles:
    def __init__(self, sandbox: SandboxHandle) -> None:
        self._sandbox = sandbox

    @property
    def _svc(self) -> SandboxService:
        return self._sandbox._service

    async def read(self, path: str, *, user: str = "", follow_symlinks: bool = True) -> bytes:
        return await self._svc.read_file(self._sandbox.id, path, user, follow_symlinks)

    async def read_text(
        self, path: str, *, user: str = "", encoding: str = "utf-8", follow_symlinks: bool = True
    ) -> str:
        data = await self.read(path, user=user, follow_symlinks=follow_symlinks)
        return data.decode(encoding)

    async def write(
        self,
        path: str,
        data: bytes | str,
        *,
        user: str = "",
        mode: int = 0o644,
        follow_symlinks: bool = True,
    ) -> int:
        """Create or replace a file (parent directories are made). Returns bytes written."""
        raw = data.encode() if isinstance(data, str) else data
        return await self._svc.write_file(self._sandbox.id, path, raw, user, mode, follow_symlinks)

    async def list(self, path: str, *, user: str = "") -> builtins.list[FileEntry]:
        return await self._svc.list_files(self._sandbox.id, path, user)

    async def stat(self, path: str, *, user: str = "") -> FileEntry:
        return await self._svc.stat_file(self._sandbox.id, path, user)

    async def exists(self, path: str, *, user: str = "") -> bool:
        try:
            await self.stat(path, user=user)
        except FileNotFound:
            return False
        return True

    async def make_dir(self, path: str, *, user: str = "") -> None:
        await self._svc.make_dir(self._sandbox.id, path, user)

    async def remove(self, path: str, *, user: str = "", recursive: bool = True) -> None:
        await self._svc.remove_file(self._sandbox.id, path, user, recursive)

    async def upload_tar(self, path: str, data: bytes) -> None:
        """Extract a tar archive into the directory `path` (made if missing)."""
        await self._svc.upload_tar(self._sandbox.id, path, data)

    async def download_tar(self, path: str) -> bytes:
        """The directory `path` as a tar archive."""
        return await self._svc.download_tar(self._sandbox.id, path)
