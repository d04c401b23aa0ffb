"""The operations a sandbox service offers, whoever implements them.

The node agent implements them in-process; HttpService (api/http.py)
implements them against `corral serve` or a gateway; a gateway's view
implements them over many nodes; the HTTP app exposes any implementation.
One interface, so embedded and remote behave the same.

Every operation but start() and aclose() travels over HTTP as one row of
api/routes.py; docs/api.md says how to add one.
"""

from __future__ import annotations

import builtins
from collections.abc import AsyncIterator
from typing import Protocol

from corral.api.models import (
    ApiKey,
    App,
    AuditReport,
    CommitRequest,
    CreateKey,
    CreateSandbox,
    DirectAccess,
    DisplayInput,
    DisplayState,
    Event,
    ExecEvent,
    ExecRequest,
    FileEntry,
    FnCallRequest,
    FnCallResult,
    ForkRequest,
    LaunchRequest,
    LayerInfo,
    LogLine,
    NetworkPolicy,
    ProtectRequest,
    RolloutReport,
    RolloutStep,
    SandboxInfo,
    SavedState,
    SaveRequest,
    Usage,
    ViewAccess,
    Window,
    XattrRequest,
)


class SandboxService(Protocol):
    async def start(self) -> object:
        """Make the service ready (idempotent: a started service returns at
        once). What it returns is the implementer's own business."""
        ...

    async def create(self, req: CreateSandbox) -> SandboxInfo: ...

    async def get(self, sandbox_id: str) -> SandboxInfo: ...

    async def list(self, labels: dict[str, str] | None = None) -> builtins.list[SandboxInfo]: ...

    async def close(self, sandbox_id: str) -> None: ...

    def exec(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]: ...

    async def kill(self, sandbox_id: str, pid: int, signal: int = 9) -> None: ...

    async def resize_pty(self, sandbox_id: str, pid: int, rows: int, cols: int) -> None:
        """A terminal command's new size (ExecRequest.pty)."""
        ...

    async def send_stdin(self, sandbox_id: str, pid: int, data: bytes, eof: bool = False) -> None:
        """More input for a running command started with stdin_open; with
        `eof`, its stdin is closed after it."""
        ...

    async def read_file(
        self, sandbox_id: str, path: str, user: str = "", follow_symlinks: bool = True
    ) -> bytes: ...

    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        data: bytes,
        user: str = "",
        mode: int = 0o644,
        follow_symlinks: bool = True,
    ) -> int: ...

    async def list_files(
        self, sandbox_id: str, path: str, user: str = ""
    ) -> builtins.list[FileEntry]: ...

    async def stat_file(self, sandbox_id: str, path: str, user: str = "") -> FileEntry: ...

    async def make_dir(self, sandbox_id: str, path: str, user: str = "") -> None: ...

    async def set_xattrs(self, sandbox_id: str, req: XattrRequest) -> None:
        """Set a file's user.* extended attributes (after clearing those
        starting with req.clear)."""
        ...

    async def remove_file(
        self, sandbox_id: str, path: str, user: str = "", recursive: bool = True
    ) -> None: ...

    async def upload_tar(self, sandbox_id: str, path: str, data: bytes) -> None: ...

    async def download_tar(self, sandbox_id: str, path: str) -> bytes: ...

    async def commit(self, sandbox_id: str, req: CommitRequest) -> LayerInfo: ...

    async def direct(self, sandbox_id: str, ttl: int = 300) -> DirectAccess:
        """A short-lived path straight to the sandbox's node, past the
        gateway (api/direct.py): issued by a gateway only."""
        ...

    async def audit(self, sandbox_id: str) -> AuditReport:
        """What the sandbox was refused and did that an honest agent would
        not: counters, findings and the node's verdict (also after it
        closed)."""
        ...

    async def protect(self, sandbox_id: str, req: ProtectRequest) -> SandboxInfo:
        """Protect paths from now on: a later write to one, or under one, is
        a protected_write violation in the report (containers)."""
        ...

    async def list_layers(self, labels: dict[str, str] | None = None) -> builtins.list[LayerInfo]:
        """The layers of the node's store whose labels include `labels`."""
        ...

    async def delete_layer(self, ref: str) -> None:
        """Untag the layer `ref` names and drop it (Conflict while a
        sandbox runs on it)."""
        ...

    async def usage(self, sandbox_id: str) -> Usage: ...

    async def command_log(
        self, sandbox_id: str, since_ms: int = 0, limit: int = 1000
    ) -> builtins.list[LogLine]:
        """The sandbox's command log from `since_ms` (Unix ms), at most
        `limit` lines, oldest first; also after it closed."""
        ...

    async def suspend(self, sandbox_id: str, mode: str = "", key: str = "") -> SandboxInfo: ...

    async def resume(self, sandbox_id: str) -> SandboxInfo: ...

    async def set_ttl(self, sandbox_id: str, ttl: int) -> SandboxInfo:
        """Close the sandbox `ttl` seconds from now (instead of when its
        create said)."""
        ...

    async def update_network(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo: ...

    async def fork(self, sandbox_id: str, req: ForkRequest) -> builtins.list[SandboxInfo]: ...

    async def save(self, sandbox_id: str, req: SaveRequest) -> SavedState: ...

    async def restore(self, req: SavedState) -> SandboxInfo: ...

    async def screenshot(
        self,
        sandbox_id: str,
        percent: int = 100,
        x: int = 0,
        y: int = 0,
        width: int = 0,
        height: int = 0,
    ) -> bytes:
        """The screen as a PNG; with a width and height, only the region
        at (x, y) of that size; with `percent` below 100, that much
        smaller (the nearest pixel)."""
        ...

    async def display_input(self, sandbox_id: str, req: DisplayInput) -> None: ...

    async def display_state(self, sandbox_id: str) -> DisplayState: ...

    async def display_windows(self, sandbox_id: str) -> builtins.list[Window]:
        """The windows the desktop shows, with titles and geometry."""
        ...

    async def display_apps(self, sandbox_id: str) -> builtins.list[App]:
        """The applications installed in the desktop image."""
        ...

    async def display_view(
        self, sandbox_id: str, interactive: bool = False, ttl: int = 300
    ) -> ViewAccess:
        """A live view of the screen (a browser opens its path on the
        server that issued it); read-only unless `interactive`."""
        ...

    async def display_launch(self, sandbox_id: str, req: LaunchRequest) -> App:
        """Start an installed application on the display; returns what was started."""
        ...

    async def run_call(self, req: FnCallRequest) -> FnCallResult: ...

    async def rollout_steps(self, rollout: str) -> builtins.list[RolloutStep]:
        """A rollout's logged steps, in order (corral/rollout/)."""
        ...

    async def rollout_append(self, rollout: str, step: RolloutStep) -> None:
        """Log the next step of a rollout (durable when this returns). The
        same step again with the same digest is a no-op; a step that is not
        the next, or that another writer logged with other arguments, is
        refused."""
        ...

    async def rollout_delete(self, rollout: str) -> None: ...

    async def rollout_report(self, rollout: str) -> RolloutReport:
        """The findings of every sandbox the rollout created (labelled
        corral.rollout), open or closed, and their worst verdict."""
        ...

    def events(self, labels: dict[str, str] | None = None) -> AsyncIterator[Event]:
        """What happens from now on to sandboxes whose labels include
        `labels`: state changes, command ends and findings, until the
        caller stops reading (SSE over HTTP)."""
        ...

    # A cluster's API keys (a gateway's; a node's server has the one key
    # it was started with, and refuses these).

    async def create_key(self, req: CreateKey) -> ApiKey:
        """A new key for the caller's project or one below it (shown once, in
        this answer's `api_key`). A key that expires makes none that
        outlives it."""
        ...

    async def list_keys(self, project: str = "") -> builtins.list[ApiKey]:
        """The keys of the caller's project and those below it (of `project`
        only, if given), oldest first: ids, life and last use, never keys."""
        ...

    async def revoke_key(self, key_id: str) -> ApiKey:
        """Revoke a key of the caller's project or one below it; every
        gateway refuses it within 5 s. Revoking a revoked key changes
        nothing."""
        ...

    async def aclose(self) -> None:
        """Release what start() took (connections, the node's workers);
        the sandboxes themselves live on."""
        ...
