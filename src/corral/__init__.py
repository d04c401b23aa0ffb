"""Corral: sandboxes for training and evaluating AI agents with RL.

An open implementation of DeepSeek's DSec design. Start here:

    import corral
    async with corral.AsyncClient() as client:
        sbx = await client.sandboxes.create(image="debian-python:bookworm")
        print((await sbx.commands.run("python3 -c 'print(1+1)'")).stdout)
        await sbx.close()
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from corral.api.models import (
    ApiKey,
    AuditReport,
    DirectAccess,
    Event,
    FileEntry,
    Finding,
    FnCallRequest,
    FnCallResult,
    NetworkPolicy,
    RolloutReport,
    SandboxInfo,
    SandboxState,
    SavedState,
    Usage,
)
from corral.api.verdict import Rules
from corral.errors import (
    Ambiguous,
    CommandNotFound,
    CommandTimeout,
    Conflict,
    CorralError,
    FileError,
    FileNotFound,
    ImageNotFound,
    InternalError,
    InvalidArgument,
    NodeFull,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SandboxClosed,
    SandboxFailed,
    SandboxLost,
    SandboxNotFound,
    Unauthenticated,
    Unavailable,
)
from corral.sdk.client import AsyncClient, AsyncSandboxes, BulkOutcome
from corral.sdk.commands import AsyncCommandHandle, AsyncCommands, CommandResult
from corral.sdk.display import AsyncDisplay
from corral.sdk.events import AsyncEventStream
from corral.sdk.files import AsyncFiles
from corral.sdk.fncall import AsyncFnCall
from corral.sdk.keys import AsyncKeys
from corral.sdk.rollouts import AsyncRollout, AsyncRollouts, AsyncRolloutSandbox
from corral.sdk.sandbox import AsyncSandbox
from corral.version import __version__

if TYPE_CHECKING:
    from corral.sdk.sync import (
        Client,
        CommandHandle,
        Commands,
        Display,
        EventStream,
        Files,
        FnCall,
        Keys,
        Network,
        Rollout,
        RolloutCommands,
        RolloutFiles,
        Rollouts,
        RolloutSandbox,
        Sandbox,
        Sandboxes,
    )

_SYNC = (
    "Client",
    "CommandHandle",
    "Commands",
    "Display",
    "EventStream",
    "Files",
    "FnCall",
    "Keys",
    "Network",
    "Rollout",
    "RolloutCommands",
    "RolloutFiles",
    "RolloutReport",
    "RolloutSandbox",
    "Rollouts",
    "Rules",
    "Sandbox",
    "Sandboxes",
)


def __getattr__(name: str) -> Any:
    # The blocking API is generated from the async one (corral/sdk/gen_sync.py);
    # importing it lazily lets the generator run even when it is stale.
    if name in _SYNC:
        from corral.sdk import sync

        return getattr(sync, name)
    raise AttributeError(f"module 'corral' has no attribute {name!r}")


__all__ = [
    "Ambiguous",
    "ApiKey",
    "AsyncClient",
    "AsyncCommandHandle",
    "AsyncCommands",
    "AsyncDisplay",
    "AsyncEventStream",
    "AsyncFiles",
    "AsyncFnCall",
    "AsyncKeys",
    "AsyncRollout",
    "AsyncRolloutSandbox",
    "AsyncRollouts",
    "AsyncSandbox",
    "AsyncSandboxes",
    "AuditReport",
    "BulkOutcome",
    "Client",
    "CommandHandle",
    "CommandNotFound",
    "CommandResult",
    "CommandTimeout",
    "Commands",
    "Conflict",
    "CorralError",
    "DirectAccess",
    "Display",
    "Event",
    "EventStream",
    "FileEntry",
    "FileError",
    "FileNotFound",
    "Files",
    "Finding",
    "FnCall",
    "FnCallRequest",
    "FnCallResult",
    "ImageNotFound",
    "InternalError",
    "InvalidArgument",
    "Keys",
    "Network",
    "NetworkPolicy",
    "NodeFull",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "Rollout",
    "RolloutCommands",
    "RolloutFiles",
    "RolloutReport",
    "RolloutSandbox",
    "Rollouts",
    "Rules",
    "Sandbox",
    "SandboxClosed",
    "SandboxFailed",
    "SandboxInfo",
    "SandboxLost",
    "SandboxNotFound",
    "SandboxState",
    "Sandboxes",
    "SavedState",
    "Unauthenticated",
    "Unavailable",
    "Usage",
    "__version__",
]
