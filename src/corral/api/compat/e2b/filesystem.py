"""envd's `filesystem.Filesystem` service over Corral's file operations.

Entries carry owner and group names, read from the sandbox's /etc/passwd
and /etc/group (as root, cached per sandbox). A move runs the platform's
busybox `mv` in the sandbox as the caller's user. Watching is polling: the
watched tree is listed every POLL seconds and the difference reported as
envd's events (a new file: CREATE, then WRITE if it has content; a changed
size or time: WRITE; a changed mode: CHMOD; gone: REMOVE). Changes undone
between two polls are not seen.
"""

from __future__ import annotations

import asyncio
import posixpath
import secrets
import stat as st
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from corral.api.compat.e2b.connect import ConnectError
from corral.api.models import ExecExit, ExecOutput, ExecRequest, FileEntry
from corral.api.service import SandboxService
from corral.errors import FileNotFound
from corral.host import platform as plat

POLL = 0.2
METADATA = "user.e2b."  # E2B's file metadata: these extended attributes
MAX_DEPTH = 32
MAX_WATCHERS = 64  # per sandbox
TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
_TYPE_BITS = {"file": st.S_IFREG, "dir": st.S_IFDIR, "symlink": st.S_IFLNK}


def resolve(path: object, home: str) -> str:
    if not isinstance(path, str) or not path:
        raise ConnectError("invalid_argument", f"path must be a non-empty string: {path!r}")
    return posixpath.normpath(path if path.startswith("/") else posixpath.join(home, path))


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


class Names:
    """uid and gid to names, per sandbox, from its own files."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[dict[int, str], dict[int, str]]] = {}

    async def of(
        self, svc: SandboxService, sandbox_id: str
    ) -> tuple[dict[int, str], dict[int, str]]:
        if sandbox_id not in self._cache:
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[sandbox_id] = (
                await self._read(svc, sandbox_id, "/etc/passwd"),
                await self._read(svc, sandbox_id, "/etc/group"),
            )
        return self._cache[sandbox_id]

    @staticmethod
    async def _read(svc: SandboxService, sandbox_id: str, path: str) -> dict[int, str]:
        try:
            text = (await svc.read_file(sandbox_id, path, "root")).decode(errors="replace")
        except Exception:
            return {}
        out: dict[int, str] = {}
        for line in text.splitlines():
            parts = line.split(":")
            if len(parts) > 2 and parts[2].isdigit():
                out.setdefault(int(parts[2]), parts[0])
        return out

    def forget(self, sandbox_id: str) -> None:
        self._cache.pop(sandbox_id, None)


def entry_info(e: FileEntry, users: dict[int, str], groups: dict[int, str]) -> dict[str, Any]:
    mode = e.mode | _TYPE_BITS.get(e.type, 0)
    out: dict[str, Any] = {
        "name": e.name,
        "type": TYPES.get(e.type, "FILE_TYPE_UNSPECIFIED"),
        "path": e.path,
        "size": str(e.size),
        "mode": e.mode,
        "permissions": st.filemode(mode),
        "owner": users.get(e.uid, str(e.uid)) if e.uid is not None else "",
        "group": groups.get(e.gid, str(e.gid)) if e.gid is not None else "",
        "modifiedTime": _rfc3339(e.mtime),
    }
    meta = {k.removeprefix(METADATA): v for k, v in e.xattrs.items() if k.startswith(METADATA)}
    if meta:
        out["metadata"] = meta
    if e.type == "dir" and e.size == 0:
        out["size"] = "4096"  # btrfs and tmpfs say 0; envd's clients expect a block
    return out


class Filesystem:
    def __init__(self) -> None:
        self.names = Names()
        self.watchers: dict[str, Watcher] = {}

    async def _entry(self, svc: SandboxService, sandbox_id: str, e: FileEntry) -> dict[str, Any]:
        users, groups = await self.names.of(svc, sandbox_id)
        target = None
        if e.type == "symlink":
            # envd: a link shows its target's type and mode, and the target's
            # absolute path; a broken one has no type.
            try:
                link = e.target or ""
                target = posixpath.normpath(posixpath.join(posixpath.dirname(e.path), link))
                t = await svc.stat_file(sandbox_id, target, "root")
                e = e.model_copy(update={"type": t.type, "mode": t.mode})
            except Exception:
                e = e.model_copy(update={"type": "other"})
        info = entry_info(e, users, groups)
        if target is not None:
            info["symlinkTarget"] = target
        return info

    async def stat(self, svc: SandboxService, sid: str, path: str, user: str) -> dict[str, Any]:
        return await self._entry(svc, sid, await svc.stat_file(sid, path, user))

    async def list_dir(
        self, svc: SandboxService, sid: str, path: str, depth: int, user: str
    ) -> list[dict[str, Any]]:
        depth = depth or 1  # the SDK sends 0 for "not given"
        if not 1 <= depth <= MAX_DEPTH:
            raise ConnectError("invalid_argument", f"depth must be 1 to {MAX_DEPTH}: {depth}")
        top = await svc.stat_file(sid, path, user)
        if top.type != "dir":
            raise ConnectError("invalid_argument", f"path {path} is not a directory")
        out: list[dict[str, Any]] = []

        async def walk(d: str, left: int) -> None:  # pre-order, by name: as envd's WalkDir
            for e in sorted(await svc.list_files(sid, d, user), key=lambda e: e.name):
                out.append(await self._entry(svc, sid, e))
                if e.type == "dir" and left > 1:
                    await walk(e.path, left - 1)

        await walk(path, depth)
        return out

    async def make_dir(self, svc: SandboxService, sid: str, path: str, user: str) -> dict[str, Any]:
        try:
            await svc.stat_file(sid, path, user)
        except FileNotFound:
            await svc.make_dir(sid, path, user)
            return await self.stat(svc, sid, path, user)
        raise ConnectError("already_exists", f"directory {path} already exists")

    async def move(
        self, svc: SandboxService, sid: str, source: str, dest: str, user: str
    ) -> dict[str, Any]:
        await svc.stat_file(sid, source, user)  # not found: not_found
        parent = posixpath.dirname(dest)
        script = 'mkdir -p "$1" && mv -f "$2" "$3"'
        req = ExecRequest(
            cmd=[plat.BUSYBOX, "sh", "-c", script, "mv", parent, source, dest],
            user=user, cwd="/", timeout=60,
        )  # fmt: skip
        err, code = b"", -1
        async for ev in svc.exec(sid, req):
            if isinstance(ev, ExecOutput) and ev.type == "stderr":
                err += ev.data
            elif isinstance(ev, ExecExit):
                code = ev.exit_code
        if code != 0:
            raise ConnectError("invalid_argument", f"move failed: {err.decode(errors='replace')}")
        return await self.stat(svc, sid, dest, user)

    # ------------------------------------------------------------ watching

    def create_watcher(
        self, svc: SandboxService, sid: str, path: str, recursive: bool, user: str
    ) -> Watcher:
        if sum(w.sandbox == sid for w in self.watchers.values()) >= MAX_WATCHERS:
            raise ConnectError("resource_exhausted", f"at most {MAX_WATCHERS} watchers a sandbox")
        w = Watcher(svc, sid, path, recursive, user)
        self.watchers[w.id] = w
        return w

    def watcher(self, watcher_id: object) -> Watcher:
        w = self.watchers.get(str(watcher_id))
        if w is None:
            raise ConnectError("not_found", f"watcher {watcher_id!r} not found")
        return w

    def remove_watcher(self, watcher_id: object) -> None:
        self.watchers.pop(str(self.watcher(watcher_id).id), None)


class Watcher:
    def __init__(
        self, svc: SandboxService, sid: str, path: str, recursive: bool, user: str
    ) -> None:
        self.id = secrets.token_hex(8)
        self.svc, self.sandbox, self.path = svc, sid, path
        self.recursive, self.user = recursive, user
        self.seen: dict[str, tuple[str, int, float, int]] | None = None

    async def _snapshot(self) -> dict[str, tuple[str, int, float, int]]:
        out: dict[str, tuple[str, int, float, int]] = {}
        level = [self.path]
        for _ in range(MAX_DEPTH if self.recursive else 1):
            below: list[str] = []
            for d in level:
                try:
                    entries = await self.svc.list_files(self.sandbox, d, self.user)
                except FileNotFound:
                    continue
                for e in entries:
                    out[e.path] = (e.type, e.size, e.mtime, e.mode)
                    if e.type == "dir":
                        below.append(e.path)
            if not below:
                break
            level = below
        return out

    async def start(self) -> None:
        top = await self.svc.stat_file(self.sandbox, self.path, self.user)
        if top.type != "dir":
            raise ConnectError("invalid_argument", f"path {self.path} is not a directory")
        self.seen = await self._snapshot()

    async def events(self) -> list[dict[str, Any]]:
        """What changed since the last call (or the start)."""
        now = await self._snapshot()
        before = self.seen or {}
        self.seen = now
        out: list[dict[str, Any]] = []

        def ev(path: str, kind: str) -> None:
            out.append({"name": posixpath.relpath(path, self.path), "type": f"EVENT_TYPE_{kind}"})

        for path, (kind, size, mtime, mode) in now.items():
            old = before.get(path)
            if old is None:
                ev(path, "CREATE")
                if kind == "file" and size > 0:
                    ev(path, "WRITE")
            elif old[1:3] != (size, mtime):
                ev(path, "WRITE")
            elif old[3] != mode:
                ev(path, "CHMOD")
        for path in before:
            if path not in now:
                ev(path, "REMOVE")
        return out

    async def stream(self, keepalive: float | None) -> AsyncIterator[dict[str, Any]]:
        # WatchDirResponse's oneof is the message itself (no "event" field).
        yield {"start": {}}
        quiet = 0.0
        while True:
            await asyncio.sleep(POLL)
            found = await self.events()
            for e in found:
                yield {"filesystem": e}
            quiet = 0.0 if found else quiet + POLL
            if keepalive and quiet >= keepalive:
                quiet = 0.0
                yield {"keepalive": {}}
