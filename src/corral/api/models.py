"""Wire models: what a request may hold, validated the same way embedded and
over HTTP, so a bad value gets the same error naming field, rule and value.

This module holds a sandbox's own models (its spec, state, network policy,
layers, audit and files); the models of commands (models_exec), of what VMs
alone do (models_vm) and of function calls (models_fncall) live beside it
and are re-exported here, so ``from corral.api.models import X`` names any
wire model.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from corral import labels
from corral.api.models_base import (
    ENV_KEY,
    PATH_RULE,
    REF,
    REF_RULE,
    USER,
    GiB,
    MiB,
    StrictModel,
    check_cpu_class,
    check_env,
    check_path,
    check_ref,
    invalid_from_pydantic,
    validated,
)
from corral.api.models_exec import ExecEvent, ExecExit, ExecOutput, ExecRequest, ExecStarted
from corral.api.models_fncall import (
    FnCallRequest,
    FnCallResult,
    FnCallStage,
    FnCallStatus,
    check_call_file_name,
)
from corral.api.models_keys import ApiKey, CreateKey
from corral.api.models_report import (
    DEFAULT_SEVERITY,
    FINDING_KINDS,
    MAX_PROTECTED,
    Event,
    Finding,
    ProtectRequest,
    RolloutReport,
    Severity,
    Verdict,
)
from corral.api.models_rollout import ROLLOUT_NAME, ROLLOUT_NAME_RULE, RolloutStep
from corral.api.models_vm import (
    App,
    DisplayInput,
    DisplayState,
    ForkRequest,
    LaunchRequest,
    SavedState,
    SaveRequest,
    ViewAccess,
    Window,
)
from corral.errors import InvalidArgument
from corral.guard.policy import NetworkPolicy
from corral.images.disks import FIRMWARES, NAME, NAME_RULE, PREFIX, is_disk
from corral.images.layer import RegistryRef
from corral.units import parse_size

__all__ = [
    "DEFAULT_DISPLAY",
    "DEFAULT_SEVERITY",
    "FINDING_KINDS",
    "FULLVM_CPU",
    "FULLVM_MEMORY",
    "KINDS",
    "MAX_DISPLAY",
    "MAX_PROTECTED",
    "MIN_DISPLAY",
    "PATH_RULE",
    "ROLLOUT_NAME",
    "ROLLOUT_NAME_RULE",
    "VM_KINDS",
    "ApiKey",
    "App",
    "AuditReport",
    "CommitRequest",
    "CreateKey",
    "CreateSandbox",
    "DirectAccess",
    "DisplayInput",
    "DisplayState",
    "Event",
    "ExecEvent",
    "ExecExit",
    "ExecOutput",
    "ExecRequest",
    "ExecStarted",
    "FileEntry",
    "Finding",
    "FnCallRequest",
    "FnCallResult",
    "FnCallStage",
    "FnCallStatus",
    "ForkRequest",
    "GiB",
    "LaunchRequest",
    "LayerInfo",
    "LogLine",
    "MiB",
    "NetworkPolicy",
    "ProtectRequest",
    "RolloutReport",
    "RolloutStep",
    "SandboxInfo",
    "SandboxState",
    "SaveRequest",
    "SavedState",
    "Severity",
    "Usage",
    "Verdict",
    "ViewAccess",
    "Window",
    "XattrRequest",
    "check_call_file_name",
    "check_path",
    "check_ref",
    "invalid_from_pydantic",
    "validated",
]

KINDS = ("container", "fncall", "microvm", "fullvm")
VM_KINDS = ("microvm", "fullvm")
DEFAULT_DISPLAY = (1024, 768)
MIN_DISPLAY = (640, 480)
MAX_DISPLAY = (2560, 1600)
FULLVM_MEMORY = 2 * 1024**3
FULLVM_CPU = 2.0
_LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")


def check_labels(v: dict[str, str], *, most: int, longest: int) -> None:
    """ValueError naming the first label past the rules of keys and sizes."""
    if len(v) > most:
        raise ValueError(f"at most {most} labels")
    for k, val in v.items():
        if not _LABEL_KEY.match(k):
            raise ValueError(f"key {k!r} must match [A-Za-z0-9][A-Za-z0-9._/-]{{0,62}}")
        if len(val) > longest:
            raise ValueError(f"value of {k!r} must be at most {longest} characters")


# What a sandbox booted from a user's own disk does without (no Corral
# kernel or agent inside it).
OWN_DISK_LACKS = {
    "workspace": "its files are the disk's own (no layers are mounted in it)",
    "toolkit": "its files are the disk's own (no layers are mounted in it)",
}


class SandboxState(StrEnum):
    creating = "creating"
    running = "running"
    closing = "closing"
    closed = "closed"
    failed = "failed"
    suspending = "suspending"
    suspended = "suspended"  # frozen or saved to disk (info.suspended); the next request resumes it
    resuming = "resuming"


class CreateSandbox(StrictModel):
    """What a caller asks for. Sizes accept '1GiB' or a byte count."""

    kind: str = "container"
    image: str
    workspace: str | None = None
    toolkit: list[str] = Field(default_factory=list)
    cpu: float = 1.0
    memory: int = 1 * GiB
    disk: int = 2 * GiB
    pids: int = 512
    ttl: float | None = 3600.0
    idle_timeout: float | None = 600.0
    # What its TTL's end does: "close" it, or "suspend" it (the kind's own
    # depth: a container freezes) or to "disk" (its memory given back),
    # with no TTL until one is set again (E2B's autoPause).
    on_expiry: Literal["close", "suspend", "disk"] = "close"
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    network: NetworkPolicy | None = None  # None: no network at all
    # A retried create with the same key returns the sandbox the first one
    # made, instead of making another (create_many's per-item keys).
    idempotency_key: str | None = None
    # A desktop's screen, (width, height) or "WxH": a full VM always has one
    # (default 1024x768); a container has one (Xvfb) when this is given.
    display_size: tuple[int, int] | None = None
    # Paths the task protects (its tests, its grader): a write to one, or
    # under one, is a `protected_write` violation in the sandbox's report.
    protected: list[str] = Field(default_factory=list)
    # "interactive" (an agent waits on its commands) or "background"
    # (builds, test suites: yields the CPU to interactive work); a command
    # may override it (docs/cpu-classes.md).
    cpu_class: str = "interactive"
    # With image "disk:NAME" (a user's own disk, kind "fullvm"): how it
    # boots, "bios" (the default) or "uefi" (docs/own-disk.md).
    firmware: str | None = None

    @field_validator("cpu_class")
    @classmethod
    def _cpu_class(cls, v: str) -> str:
        return check_cpu_class(v)

    @field_validator("firmware")
    @classmethod
    def _firmware(cls, v: str | None, info: Any) -> str | None:
        if v is None:
            return v
        if v not in FIRMWARES:
            raise ValueError(f"must be one of {', '.join(FIRMWARES)}")
        if not is_disk(info.data.get("image", "")):
            raise ValueError(
                "is for a user's own disk (image 'disk:NAME'): Corral's images boot Corral's kernel"
            )
        return v

    @field_validator("workspace", mode="after")
    @classmethod
    def _not_on_own_disk(cls, v: object, info: Any) -> object:
        if v is not None and is_disk(info.data.get("image", "")):
            raise ValueError(
                "cannot be given with a user's own disk (image 'disk:NAME'): "
                + OWN_DISK_LACKS[info.field_name]
            )
        return v

    @field_validator("protected", mode="before")
    @classmethod
    def _protected(cls, v: object) -> object:
        if isinstance(v, list):
            if len(v) > MAX_PROTECTED:
                raise ValueError(f"at most {MAX_PROTECTED} paths")
            return [check_path(p, "protected") for p in v]
        return v

    @field_validator("display_size", mode="before")
    @classmethod
    def _display_size(cls, v: object, info: Any) -> object:
        if v is not None and info.data.get("kind") not in ("fullvm", "container"):
            raise ValueError(
                f"is for kinds 'fullvm' and 'container' (a desktop), not {info.data.get('kind')!r}"
            )
        if isinstance(v, str):
            m = re.fullmatch(r"(\d{1,5})x(\d{1,5})", v)
            if m is None:
                raise ValueError("must be 'WIDTHxHEIGHT' like '1280x800'")
            v = (int(m.group(1)), int(m.group(2)))
        if isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(n, int) for n in v):
            w, h = v
            if not (
                MIN_DISPLAY[0] <= w <= MAX_DISPLAY[0] and MIN_DISPLAY[1] <= h <= MAX_DISPLAY[1]
            ):
                raise ValueError(
                    f"must be between {MIN_DISPLAY[0]}x{MIN_DISPLAY[1]} and "
                    f"{MAX_DISPLAY[0]}x{MAX_DISPLAY[1]} (the VGA's 16 MiB)"
                )
        return v

    @model_validator(mode="after")
    def _kind_defaults(self) -> CreateSandbox:
        if self.kind == "fullvm":
            # A desktop needs more than a shell: bigger defaults, unless asked.
            if "memory" not in self.model_fields_set:
                self.memory = FULLVM_MEMORY
            if "cpu" not in self.model_fields_set:
                self.cpu = FULLVM_CPU
            if self.display_size is None:
                self.display_size = DEFAULT_DISPLAY
        return self

    @field_validator("idempotency_key")
    @classmethod
    def _idempotency_key(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", v):
            raise ValueError("must be 1-128 characters of letters, digits and . _ : -")
        return v

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        if v not in KINDS:
            raise ValueError(f"must be one of {', '.join(KINDS)}")
        return v

    @field_validator("image")
    @classmethod
    def _image(cls, v: str, info: Any) -> str:
        if is_disk(v):
            if not NAME.fullmatch(v.removeprefix(PREFIX)):
                raise ValueError(NAME_RULE)
            if info.data.get("kind") != "fullvm":
                raise ValueError("a user's own disk ('disk:NAME') boots only as kind 'fullvm'")
            return v
        # An image may also be an OCI registry's (pulled on first use).
        try:
            remote = RegistryRef.parse(v)
        except InvalidArgument as exc:
            raise ValueError(exc.details.get("rule") or REF_RULE) from None
        if remote is None and not REF.match(v):
            raise ValueError(REF_RULE + ", or an OCI registry's like 'host[:port]/repo:tag'")
        return v

    @field_validator("workspace")
    @classmethod
    def _ref(cls, v: str | None) -> str | None:
        if v is not None and not REF.match(v):
            raise ValueError(REF_RULE)
        return v

    @field_validator("toolkit", mode="before")
    @classmethod
    def _toolkit(cls, v: object, info: Any) -> object:
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if v and is_disk(info.data.get("image", "")):
            raise ValueError(
                "cannot be given with a user's own disk (image 'disk:NAME'): "
                + OWN_DISK_LACKS["toolkit"]
            )
        if isinstance(v, list):
            if len(v) > 16:
                raise ValueError("at most 16 toolkit layers")
            for item in v:
                if not isinstance(item, str) or not REF.match(item):
                    raise ValueError(
                        "each must be a layer reference like 'name:tag' or 'sha256:<64 hex>'"
                    )
        return v

    @field_validator("cpu")
    @classmethod
    def _cpu(cls, v: float) -> float:
        if not 0.01 <= v <= 256:
            raise ValueError("must be between 0.01 and 256 cores")
        return v

    @field_validator("memory", "disk", mode="before")
    @classmethod
    def _size(cls, v: object, info: Any) -> int:
        n = parse_size(v, info.field_name)
        if not 16 * MiB <= n <= 4096 * GiB:
            raise ValueError("must be between 16MiB and 4TiB")
        return n

    @field_validator("pids")
    @classmethod
    def _pids(cls, v: int) -> int:
        if not 8 <= v <= 1_000_000:
            raise ValueError("must be between 8 and 1000000")
        return v

    @field_validator("ttl", "idle_timeout")
    @classmethod
    def _seconds(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v <= 30 * 86400:
            raise ValueError("must be a number of seconds above 0 and at most 30 days, or null")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return check_env(v)

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        check_labels(v, most=64, longest=256)
        if labels.POOL in v:
            raise ValueError(f"key {labels.POOL!r} marks the node's own workers")
        return v


class SandboxInfo(BaseModel):
    id: str
    node: str
    kind: str
    state: SandboxState
    image: str
    workspace: str | None
    toolkit: list[str]
    layers: list[str]
    cpu: float
    memory: int
    disk: int
    pids: int
    ttl: float | None
    idle_timeout: float | None
    env: dict[str, str]
    labels: dict[str, str]
    created_at: float
    expires_at: float | None
    error: str | None = None
    on_expiry: str = "close"
    workdir: str = "/"
    network: NetworkPolicy | None = None
    address: str | None = None
    display_size: tuple[int, int] | None = None  # a full VM's screen
    suspended: Literal["freeze", "disk"] | None = None  # a suspended sandbox's depth
    cpu_class: str = "interactive"


class CommitRequest(StrictModel):
    """Turn a sandbox's writable layer into a new image layer. `labels`
    go on the layer (list_layers finds it by them); keys starting with
    `corral.` are the platform's (its build cache is keyed by them)."""

    tag: str
    kind: Literal["base", "workspace", "toolkit", "layer"] = "layer"
    labels: dict[str, str] = Field(default_factory=dict)
    # stack: the layer is part of the sandbox's image, on top of it (an
    # image of its own, as a Dockerfile step makes); the sandbox must then
    # have no workspace or toolkit. env, workdir, user: the new image's
    # config (a stack's top carries the whole image's).
    stack: bool = False
    env: list[str] = Field(default_factory=list)
    workdir: str | None = None
    user: str | None = None

    @field_validator("env")
    @classmethod
    def _env(cls, v: list[str]) -> list[str]:
        if len(v) > 1024:
            raise ValueError("at most 1024 variables")
        for item in v:
            key, sep, _ = item.partition("=")
            if not sep or not ENV_KEY.match(key) or "\x00" in item:
                raise ValueError(f"each must be NAME=value with a shell name, not {item[:80]!r}")
        return v

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str | None) -> str | None:
        return None if v is None else check_path(v, "workdir")

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        if v is not None and not USER.match(v):
            raise ValueError("must be a user name or uid[:gid]")
        return v

    @field_validator("tag")
    @classmethod
    def _tag(cls, v: str) -> str:
        if not REF.match(v) or v.startswith("sha256:"):
            raise ValueError("must be a tag like 'name:tag'")
        return v

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        check_labels(v, most=16, longest=4096)
        for k in v:
            if k.startswith("corral."):
                raise ValueError(f"key {k!r} must not start with 'corral.'")
        return v


class LayerInfo(BaseModel):
    digest: str
    names: list[str]
    kind: str
    parent: str | None
    content_size: int
    meta_size: int
    blob_size: int
    chunk_size: int
    created: float
    labels: dict[str, str] = Field(default_factory=dict)
    # A node's listing: a sandbox of that node (running, paused or waiting in
    # a warm pool) is on this layer, so the node will not delete it now.
    in_use: bool = False


class AuditReport(BaseModel):
    """What a sandbox was refused, hit, or had killed, counted by the
    platform (never by the sandbox itself)."""

    sandbox: str
    syscalls_denied: dict[str, int] = Field(default_factory=dict)  # by class
    syscalls: dict[str, int] = Field(default_factory=dict)  # by name
    oom_kills: int = 0
    pids_limit_hits: int = 0
    commands: int = 0
    commands_timed_out: int = 0
    commands_killed: int = 0
    output_truncated: int = 0
    output_dropped_bytes: int = 0
    log_bytes: int = 0
    log_quota_hits: int = 0
    egress_denied: int = 0
    dns_denied: int = 0  # queries refused: a name not allowed, or past the resolver's rate
    dns_denied_names: dict[str, int] = Field(default_factory=dict)  # which (the first 32)
    dns_flooded: int = 0  # queries dropped in the kernel past the per-sandbox rate
    dns_rebinding: int = 0  # answers of allowed names pointing inside, dropped
    console_dropped_bytes: int = 0  # a VM guest's console beyond its cap, trimmed
    replies_refused: int = 0  # exec server answers over what was asked (a VM guest's)
    disk_used: int | None = None
    disk_limit: int | None = None
    # The misbehaviour report (api/models_report.py): what the counters
    # above mean, entry by entry, and the node's verdict on them.
    findings: list[Finding] = Field(default_factory=list)
    verdict: Verdict = "clean"


class DirectAccess(BaseModel):
    """A short-lived direct path to a sandbox's node, issued by a gateway
    (api/direct.py): send `token` as the bearer key to `url`, naming the
    sandbox `sandbox_id`, until `expires_at` (Unix seconds)."""

    sandbox_id: str
    url: str
    token: str
    expires_at: float


class Usage(BaseModel):
    """What a sandbox uses now, read by the platform from its cgroup and its
    writable layer (never from inside the sandbox). A suspended sandbox uses
    no CPU; its memory is what the freeze kept (0 on disk)."""

    sandbox: str
    at: float  # when it was read (Unix seconds)
    cpu: float  # CPUs it may use
    cpu_seconds: float  # user + system, since it started
    memory_used: int
    memory_limit: int
    disk_used: int | None = None
    disk_limit: int | None = None
    pids: int = 0


class LogLine(BaseModel):
    """One line of a sandbox's command log (what the platform saw run:
    argv, user, outcome, exit, sizes), JSON as written; `ts` is its time."""

    ts: float
    line: str


class FileEntry(BaseModel):
    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float
    uid: int | None = None  # the owner, as the sandbox numbers it
    gid: int | None = None
    target: str | None = None  # where a symbolic link points
    xattrs: dict[str, str] = Field(default_factory=dict)  # its user.* extended attributes


class XattrRequest(StrictModel):
    """Set a file's user.* extended attributes (E2B's file metadata)."""

    path: str
    user: str = ""
    clear: str = ""  # first remove the user.* attributes whose names start so
    values: dict[str, str] = Field(default_factory=dict)

    @field_validator("values")
    @classmethod
    def _values(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > 32:
            raise ValueError("at most 32 attributes")
        for k, val in v.items():
            if not re.fullmatch(r"user\.[A-Za-z0-9._-]{1,200}", k):
                raise ValueError(f"name {k!r} must be user.<letters, digits . _ ->")
            if len(val.encode()) > 4096 or "\x00" in val:
                raise ValueError(f"value of {k!r} must be at most 4096 bytes, without NUL")
        return v

    @field_validator("clear")
    @classmethod
    def _clear(cls, v: str) -> str:
        if v and not v.startswith("user."):
            raise ValueError("must be empty or start with 'user.'")
        return v
