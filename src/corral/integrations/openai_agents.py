"""A native sandbox provider for the OpenAI Agents SDK (`pip install
corral[openai-agents]`): a SandboxAgent's shell, file and patch tools act in
a Corral sandbox.

    client = CorralSandboxClient()                 # CORRAL_URL, or embedded
    run_config = RunConfig(sandbox=SandboxRunConfig(
        client=client, options=CorralSandboxOptions(image="debian-python:bookworm")))
    await Runner.run(agent, "fix the tests", run_config=run_config)

The SDK materialises the agent's manifest (files, dirs, repos) through
this session's exec/read/write, and snapshots the workspace through
persist_workspace/hydrate_workspace (a tar of the workspace root).

Pause and resume: with `on_shutdown="suspend"` a session's shutdown
suspends its sandbox (memory, processes and files kept) instead of
closing it; `client.serialize_session_state(session.state)` is the
handle, and `client.resume(state)`, even from another process, resumes
that same sandbox with its running processes. A sandbox gone by then
(its TTL passed) is replaced by a new one, which the SDK refills from
its snapshot. `client.delete(session)` always closes.
"""

from __future__ import annotations

import io
import uuid
from pathlib import Path
from typing import Any, Literal

from agents.sandbox import ExecResult, Manifest
from agents.sandbox.errors import (
    ExecTimeoutError,
    ExecTransportError,
    WorkspaceArchiveReadError,
    WorkspaceArchiveWriteError,
    WorkspaceReadNotFoundError,
)
from agents.sandbox.session import (
    BaseSandboxClient,
    BaseSandboxClientOptions,
    BaseSandboxSession,
    SandboxSession,
    SandboxSessionState,
)
from agents.sandbox.snapshot import SnapshotBase, SnapshotSpec, resolve_snapshot

from corral.errors import CommandTimeout, CorralError, FileNotFound, SandboxNotFound
from corral.integrations.connect import client as connect
from corral.sdk.client import AsyncClient
from corral.sdk.sandbox import AsyncSandbox

BACKEND = "corral"


class CorralSandboxOptions(BaseSandboxClientOptions):  # type: ignore[misc]
    """The sandbox to create: create()'s fields."""

    type: Literal["corral"] = "corral"
    image: str = "debian-python:bookworm"
    kind: str = "container"
    workspace: str | None = None
    toolkit: str | list[str] | None = None
    cpu: float | None = None
    memory: int | str | None = None
    disk: int | str = "2GiB"
    ttl: float | None = 3600
    idle_timeout: float | None = 600
    network: dict[str, Any] | None = None
    env: dict[str, str] | None = None
    labels: dict[str, str] | None = None
    on_shutdown: Literal["close", "suspend"] = "close"

    def create_fields(self) -> dict[str, Any]:
        # The base class's dump always carries `type`; take create()'s own.
        dumped = self.model_dump()
        fields: dict[str, Any] = {k: dumped[k] for k in _CREATE_FIELDS}
        fields["labels"] = {**(self.labels or {}), "openai-agents": "sandbox"}
        return fields


_CREATE_FIELDS = (
    "image",
    "kind",
    "workspace",
    "toolkit",
    "cpu",
    "memory",
    "disk",
    "ttl",
    "idle_timeout",
    "network",
    "env",
    "labels",
)


class CorralSessionState(SandboxSessionState):  # type: ignore[misc]
    type: Literal["corral"] = "corral"
    sandbox_id: str
    options: CorralSandboxOptions


class CorralSandboxSession(BaseSandboxSession):  # type: ignore[misc]
    state: CorralSessionState

    def __init__(self, state: CorralSessionState, sandbox: AsyncSandbox) -> None:
        self.state = state
        self.sandbox = sandbox

    @property
    def _root(self) -> str:
        return str(self.state.manifest.root)

    async def _prepare_backend_workspace(self) -> None:
        # The SDK's first commands run in the root; it must exist first.
        await self.sandbox.files.make_dir(self._root)

    async def _exec_internal(
        self, *command: str | Path, timeout: float | None = None
    ) -> ExecResult:
        argv = [str(c) for c in command]
        env = await self.state.manifest.environment.resolve()
        try:
            r = await self.sandbox.commands.run(
                argv, cwd=self._root, env=dict(env) or None, timeout=timeout or 600
            )
        except CommandTimeout as exc:
            raise ExecTimeoutError(command=tuple(argv), timeout_s=timeout, cause=exc) from exc
        except CorralError as exc:
            raise ExecTransportError(command=tuple(argv), cause=exc) from exc
        return ExecResult(stdout=r.stdout.encode(), stderr=r.stderr.encode(), exit_code=r.exit_code)

    async def read(self, path: Path | str, *, user: Any = None) -> io.IOBase:
        target = self.normalize_path(path)
        try:
            return io.BytesIO(await self.sandbox.files.read(target.as_posix(), user=_user(user)))
        except FileNotFound as exc:
            raise WorkspaceReadNotFoundError(path=target, cause=exc) from exc
        except CorralError as exc:
            raise WorkspaceArchiveReadError(path=target, cause=exc) from exc

    async def write(self, path: Path | str, data: io.IOBase, *, user: Any = None) -> None:
        target = self.normalize_path(path, for_write=True)
        payload = data.read()
        raw = payload.encode() if isinstance(payload, str) else bytes(payload)
        try:
            await self.sandbox.files.write(target.as_posix(), raw, user=_user(user))
        except CorralError as exc:
            raise WorkspaceArchiveWriteError(path=target, cause=exc) from exc

    async def running(self) -> bool:
        try:
            return (await self.sandbox.refresh()).state == "running"
        except CorralError:
            return False

    async def persist_workspace(self) -> io.IOBase:
        try:
            return io.BytesIO(await self.sandbox.files.download_tar(self._root))
        except CorralError as exc:
            raise WorkspaceArchiveReadError(path=Path(self._root), cause=exc) from exc

    async def hydrate_workspace(self, data: io.IOBase) -> None:
        try:
            await self.sandbox.files.upload_tar(self._root, data.read())
        except CorralError as exc:
            raise WorkspaceArchiveWriteError(path=Path(self._root), cause=exc) from exc

    async def _shutdown_backend(self) -> None:
        try:
            if self.state.options.on_shutdown == "suspend":
                await self.sandbox.suspend()
            else:
                await self.sandbox.close()
        except SandboxNotFound:
            pass


def _user(user: Any) -> str:
    if user is None:
        return ""
    return user if isinstance(user, str) else str(getattr(user, "name", user))


class CorralSandboxClient(BaseSandboxClient[CorralSandboxOptions]):  # type: ignore[misc]
    backend_id = BACKEND
    supports_default_options = True

    def __init__(
        self,
        url: str | None = None,
        *,
        api_key: str | None = None,
        corral: AsyncClient | None = None,
    ) -> None:
        super().__init__()
        self.corral = corral or connect(url, api_key)

    async def create(
        self,
        *,
        snapshot: SnapshotSpec | SnapshotBase | None = None,
        manifest: Manifest | None = None,
        options: CorralSandboxOptions | None = None,
    ) -> SandboxSession:
        manifest = manifest or Manifest()
        self._validate_manifest_for_create(manifest)
        options = options or CorralSandboxOptions()
        sandbox = await self.corral.sandboxes.create(**options.create_fields())
        session_id = uuid.uuid4()
        state = CorralSessionState(
            session_id=session_id,
            manifest=manifest,
            snapshot=resolve_snapshot(snapshot, str(session_id)),
            sandbox_id=sandbox.id,
            options=options,
        )
        return self._wrap_session(CorralSandboxSession(state, sandbox))

    async def delete(self, session: SandboxSession) -> SandboxSession:
        inner = session._inner
        assert isinstance(inner, CorralSandboxSession)
        try:
            await inner.sandbox.close()
        except SandboxNotFound:
            pass
        return session

    async def resume(self, state: SandboxSessionState) -> SandboxSession:
        assert isinstance(state, CorralSessionState), type(state)
        state.assert_path_grants_rebound()
        try:
            sandbox = await self.corral.sandboxes.get(state.sandbox_id)
            if sandbox.info.state == "suspended":
                await sandbox.resume()
            preserved = sandbox.info.state in ("running", "suspended")
        except SandboxNotFound:
            preserved = False
        if not preserved:
            # Gone (its TTL, a lost node): a new one, filled from the snapshot.
            sandbox = await self.corral.sandboxes.create(**state.options.create_fields())
            state.sandbox_id = sandbox.id
            state.workspace_root_ready = False
        inner = CorralSandboxSession(state, sandbox)
        inner._set_start_state_preserved(preserved)
        return self._wrap_session(inner)

    def deserialize_session_state(self, payload: dict[str, object]) -> SandboxSessionState:
        return self._deserialize_session_state_payload(payload, CorralSessionState)
