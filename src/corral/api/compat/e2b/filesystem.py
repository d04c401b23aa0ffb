"""envd's `filesystem.Filesystem` service over Corral's file operations.

Entries carry owner and group names, read from the sandbox's /etc/passwd
and /etc/group (as root, cached per sandbox). A move runs the platform's
busybox `mv` in the sandbox as the caller's user. Watching reports
envd's events, from inotify inside the sandbox (Watcher).
"""

from __future__ import annotations

import asyncio
import contextlib
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

METADATA = "user.e2b."  # E2B's file metadata: these extended attributes
MAX_DEPTH = 32
# A ListDir's entries over all the directories it walks: each listing is
# capped (execd/client.py), their sum must be too (the sandbox makes them).
MAX_LISTED = 100_000
MAX_WATCHERS = 64  # per sandbox
# What is read of a sandbox's /etc/passwd and /etc/group, and the names
# kept from each (the sandbox writes them; corral-init reads them as far).
NAMES_FILE_MAX = 4 << 20
NAMES_MAX = 65_536
# Events a watcher keeps for its next poll, and for a stream that lags:
# beyond them the oldest are dropped (as inotify drops past its queue).
MAX_PENDING = 65536
MAX_LIVE = 1024
# A watcher's record (corral-watch: "E<mask>:<path>\0"): a path and a few
# bytes; a longer one is not corral-watch's.
RECORD_MAX = 4096 + 64
TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
_TYPE_BITS = {"file": st.S_IFREG, "dir": st.S_IFDIR, "symlink": st.S_IFLNK}


def resolve(path: object, home: str) -> str:
    if not isinstance(path, str) or not path:
        raise ConnectError("invalid_argument", f"path must be a non-empty string: {path!r}")
    return posixpath.normpath(path if path.startswith("/") else posixpath.join(home, path))


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


async def ensure_dirs(svc: SandboxService, sid: str, path: str, user: str) -> None:
    """envd's EnsureDirs: each missing directory of `path` is made by root
    and given to `user`, so a caller's user can have /workspace made for it
    (envd runs as root; the caller holds the sandbox's token, not its code)."""
    missing: list[str] = []
    d = path
    while d not in ("/", ""):
        try:
            await svc.stat_file(sid, d, "root")
            break
        except FileNotFound:
            missing.insert(0, d)
            d = posixpath.dirname(d)
    if not missing:
        return
    script = 'for d; do mkdir "$d" && chown "$U": "$d" || exit 1; done'
    code, err = await busybox_sh(svc, sid, script, missing, user="root", env={"U": user})
    if code != 0:
        raise ConnectError("permission_denied", f"making {path}: {err}")


async def busybox_sh(
    svc: SandboxService, sid: str, script: str, args: list[str], *, user: str,
    env: dict[str, str] | None = None,
) -> tuple[int, str]:  # fmt: skip
    """Run `script` with the platform's busybox sh in the sandbox (never
    the image's tools): its exit code and what it said on stderr."""
    req = ExecRequest(cmd=[plat.BUSYBOX, "sh", "-c", script, "sh", *args],
                      env=env or {}, user=user, cwd="/", timeout=60)  # fmt: skip
    err, code = b"", -1
    async for ev in svc.exec(sid, req):
        if isinstance(ev, ExecOutput) and ev.type == "stderr":
            err += ev.data[: 4096 - len(err)]
        elif isinstance(ev, ExecExit):
            code = ev.exit_code
    return code, err.decode(errors="replace")


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
        # The platform's head, not a whole-file read: the file is the
        # sandbox's to make as large as its disk (or a link to /dev/zero).
        req = ExecRequest(cmd=[plat.BUSYBOX, "head", "-c", str(NAMES_FILE_MAX), path],
                          user="root", cwd="/", timeout=30, stdout_limit=NAMES_FILE_MAX,
                          stderr_limit=4096)  # fmt: skip
        data = bytearray()
        try:
            async for ev in svc.exec(sandbox_id, req):
                if isinstance(ev, ExecOutput) and ev.type == "stdout":
                    data += ev.data[: NAMES_FILE_MAX - len(data)]
        except Exception:
            return {}
        out: dict[int, str] = {}
        for line in data.decode(errors="replace").splitlines():
            parts = line.split(":")
            if len(parts) > 2 and parts[2].isdigit():
                out.setdefault(int(parts[2]), parts[0])
                if len(out) >= NAMES_MAX:
                    break
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
                if len(out) >= MAX_LISTED:
                    raise ConnectError(
                        "resource_exhausted",
                        f"{path}: more than {MAX_LISTED} entries to depth {depth}",
                    )
                out.append(await self._entry(svc, sid, e))
                if e.type == "dir" and left > 1:
                    await walk(e.path, left - 1)

        await walk(path, depth)
        return out

    async def make_dir(self, svc: SandboxService, sid: str, path: str, user: str) -> dict[str, Any]:
        try:
            await svc.stat_file(sid, path, user)
        except FileNotFound:
            await ensure_dirs(svc, sid, path, user)
            return await self.stat(svc, sid, path, user)
        raise ConnectError("already_exists", f"directory {path} already exists")

    async def move(
        self, svc: SandboxService, sid: str, source: str, dest: str, user: str
    ) -> dict[str, Any]:
        await svc.stat_file(sid, source, user)  # not found: not_found
        await ensure_dirs(svc, sid, posixpath.dirname(dest), user)
        code, err = await busybox_sh(svc, sid, 'mv -f "$1" "$2"', [source, dest], user=user)
        if code != 0:
            raise ConnectError("invalid_argument", f"move failed: {err}")
        return await self.stat(svc, sid, dest, user)

    # ------------------------------------------------------------ watching

    def create_watcher(
        self, svc: SandboxService, sid: str, path: str, recursive: bool, user: str,
        include_entry: bool = False,
    ) -> Watcher:  # fmt: skip
        if sum(w.sandbox == sid for w in self.watchers.values()) >= MAX_WATCHERS:
            raise ConnectError("resource_exhausted", f"at most {MAX_WATCHERS} watchers a sandbox")
        w = Watcher(svc, sid, path, recursive, user, self.names, include_entry)
        self.watchers[w.id] = w
        return w

    def watcher(self, sid: str, watcher_id: object) -> Watcher:
        """Watcher `watcher_id` of sandbox `sid` (the one whose token the
        caller showed): another sandbox's is not found, like a forged one."""
        w = self.watchers.get(str(watcher_id))
        if w is None or w.sandbox != sid:
            raise ConnectError("not_found", f"watcher {watcher_id!r} not found")
        return w

    async def remove_watcher(self, sid: str, watcher_id: object) -> None:
        w = self.watchers.pop(str(self.watcher(sid, watcher_id).id))
        await w.close()


# inotify's bits, as envd names them, in the order envd reports one event's.
_OPS = (
    (0x100 | 0x80, "CREATE"),  # IN_CREATE, IN_MOVED_TO
    (0x40 | 0x800, "RENAME"),  # IN_MOVED_FROM, IN_MOVE_SELF
    (0x4, "CHMOD"),  # IN_ATTRIB
    (0x2, "WRITE"),  # IN_MODIFY
    (0x200 | 0x400, "REMOVE"),  # IN_DELETE, IN_DELETE_SELF
)
_WATCH_EXIT = {3: "not_found", 4: "invalid_argument"}  # corral-watch's exit codes


class Watcher:
    """inotify in the sandbox: the platform's corral-watch, run as the
    watching user, reports each change as it happens; a poll asks it to
    read what the kernel has queued so far (a line on its stdin) and takes
    every event before its answer, so a change made before the poll is
    always in it."""

    def __init__(
        self, svc: SandboxService, sid: str, path: str, recursive: bool, user: str,
        names: Names, include_entry: bool = False,
    ) -> None:  # fmt: skip
        self.id = secrets.token_hex(8)
        self.svc, self.sandbox, self.path = svc, sid, path
        self.recursive, self.user, self.names = recursive, user, names
        self.include_entry = include_entry
        self.pid = 0
        self.pending: list[dict[str, Any]] = []  # events not yet taken by a poll
        self.live: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(MAX_LIVE)
        self.dropped = 0
        self._synced = asyncio.Condition()
        self._syncs = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        argv = [plat.WATCH, *(["--recursive"] if self.recursive else []), self.path]
        req = ExecRequest(cmd=argv, user=self.user, cwd="/", timeout=None, stdin_open=True,
                          stdout_limit=256 << 20)  # fmt: skip
        events = aiter(self.svc.exec(self.sandbox, req))
        armed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._pump(events, armed))
        await armed

    async def _pump(self, events: AsyncIterator[Any], armed: asyncio.Future[None]) -> None:
        buf, err = bytearray(), bytearray()
        try:
            async for ev in events:
                if isinstance(ev, ExecOutput) and ev.type == "stderr":
                    err += ev.data[: 4096 - len(err)]
                elif isinstance(ev, ExecOutput):
                    buf += ev.data
                    start = 0
                    while (end := buf.find(b"\0", start)) >= 0:
                        await self._record(buf[start:end].decode(errors="surrogateescape"), armed)
                        start = end + 1
                    del buf[:start]
                    if len(buf) > RECORD_MAX:
                        # Not corral-watch's: a process of the watching
                        # user can write to its stdout (/proc/<pid>/fd/1).
                        raise ConnectError(
                            "resource_exhausted",
                            f"the watcher of {self.path} sent a record over {RECORD_MAX} bytes",
                        )
                elif isinstance(ev, ExecExit) and not armed.done():
                    code = _WATCH_EXIT.get(ev.exit_code, "internal")
                    message = err.decode(errors="replace").strip() or f"exit {ev.exit_code}"
                    armed.set_exception(ConnectError(code, message))
                elif hasattr(ev, "pid"):
                    self.pid = ev.pid
        except Exception as exc:
            if not armed.done():
                armed.set_exception(exc)
        finally:
            close = getattr(events, "aclose", None)
            if close is not None:  # ends corral-watch with its session
                with contextlib.suppress(Exception):
                    await close()
            if not armed.done():
                armed.set_exception(ConnectError("internal", "the watcher ended"))
            if self.live.full():
                self.live.get_nowait()
            self.live.put_nowait(None)
            async with self._synced:
                self._syncs = -1  # no answer will come
                self._synced.notify_all()

    async def _record(self, r: str, armed: asyncio.Future[None]) -> None:
        if r == "R" and not armed.done():
            armed.set_result(None)
        elif r == "S":
            async with self._synced:
                self._syncs += 1
                self._synced.notify_all()
        elif r.startswith("E"):
            mask_hex, _, rel = r[1:].partition(":")
            mask = int(mask_hex, 16)
            for bits, name in _OPS:
                if mask & bits:
                    ev: dict[str, Any] = {"name": rel, "type": f"EVENT_TYPE_{name}"}
                    if self.include_entry and name in ("CREATE", "WRITE", "CHMOD"):
                        entry = await self._entry(posixpath.join(self.path, rel))
                        if entry is not None:
                            ev["entry"] = entry
                    self.pending.append(ev)
                    if len(self.pending) > MAX_PENDING:
                        del self.pending[0]
                        self.dropped += 1
                    if self.live.full():
                        self.live.get_nowait()
                        self.dropped += 1
                    self.live.put_nowait(ev)

    async def _entry(self, path: str) -> dict[str, Any] | None:
        try:
            e = await self.svc.stat_file(self.sandbox, path, self.user)
        except Exception:
            return None  # gone again
        users, groups = await self.names.of(self.svc, self.sandbox)
        return entry_info(e, users, groups)

    async def events(self) -> list[dict[str, Any]]:
        """Every change since the last poll (or the start)."""
        async with self._synced:
            want = self._syncs + 1
            if self._syncs < 0:
                raise ConnectError("not_found", f"watcher {self.id} has ended")
            await self.svc.send_stdin(self.sandbox, self.pid, b"\n")
            async with asyncio.timeout(10):
                await self._synced.wait_for(lambda: self._syncs >= want or self._syncs < 0)
        taken, self.pending = self.pending, []
        return taken

    async def stream(self, keepalive: float | None) -> AsyncIterator[dict[str, Any]]:
        # WatchDirResponse's oneof is the message itself (no "event" field).
        yield {"start": {}}
        while True:
            try:
                async with asyncio.timeout(keepalive):
                    ev = await self.live.get()
            except TimeoutError:
                yield {"keepalive": {}}
                continue
            if ev is None:
                return
            self.pending.clear()  # a stream takes them as they come
            yield {"filesystem": ev}

    async def close(self) -> None:
        if self.pid:
            with contextlib.suppress(Exception):
                await self.svc.send_stdin(self.sandbox, self.pid, b"", eof=True)
        if self._task is not None:
            try:
                async with asyncio.timeout(5):
                    await asyncio.shield(self._task)
            except Exception:
                self._task.cancel()
