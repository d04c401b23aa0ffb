"""Wire models: what a request may hold, validated the same way embedded and
over HTTP, so a bad value gets the same error naming field, rule and value.
"""

from __future__ import annotations

import posixpath
import re
from enum import StrEnum
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from corral.errors import InvalidArgument
from corral.units import parse_size

MiB = 1024 * 1024
GiB = 1024 * MiB

KINDS = ("container", "fncall", "microvm", "fullvm")
VM_KINDS = ("microvm", "fullvm")
DEFAULT_DISPLAY = (1024, 768)
MIN_DISPLAY = (640, 480)
MAX_DISPLAY = (2560, 1600)
FULLVM_MEMORY = 2 * 1024**3
FULLVM_CPU = 2.0
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")
_USER = re.compile(r"^(?:[a-z_][a-z0-9_.-]{0,31}|\d{1,10}(?::\d{1,10})?)$")
_REF = re.compile(
    r"^[a-z0-9][a-z0-9._/-]{0,127}(?::[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?$|^sha256:[0-9a-f]{64}$"
)
PATH_RULE = "must be an absolute path inside the sandbox, without '..' or NUL"


def check_path(value: object, field: str = "path") -> str:
    """An absolute, '..'-free path, normalised ('//' and '.' collapsed)."""
    if not isinstance(value, str) or not value.startswith("/") or "\x00" in value:
        raise InvalidArgument(field, PATH_RULE, value)
    if ".." in value.split("/") or len(value) > 4096:
        raise InvalidArgument(field, PATH_RULE, value)
    return posixpath.normpath(value).replace("//", "/")


def check_ref(value: object, field: str) -> str:
    if not isinstance(value, str) or not _REF.match(value):
        raise InvalidArgument(
            field, "must be a layer reference like 'name:tag' or 'sha256:<64 hex>'", value
        )
    return value


def _env(value: dict[str, str], field: str) -> dict[str, str]:
    for k, v in value.items():
        if not _ENV_KEY.match(k):
            raise ValueError(f"key {k!r} must match [A-Za-z_][A-Za-z0-9_]*")
        if "\x00" in v or len(v) > 128 * 1024:
            raise ValueError(f"value of {k!r} must be under 128 KiB and hold no NUL")
    if len(value) > 1024:
        raise ValueError("at most 1024 variables")
    return value


_M = TypeVar("_M", bound=BaseModel)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


def validated(model: type[_M], data: dict[str, Any]) -> _M:
    """Build a model, turning pydantic's error into InvalidArgument."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid_from_pydantic(exc) from None


def invalid_from_pydantic(exc: ValidationError) -> InvalidArgument:
    first = exc.errors()[0]
    field = ".".join(str(p) for p in first["loc"]) or "request"
    rule = str(first["msg"]).removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        rule = "is not a known field"
    return InvalidArgument(field, rule, first.get("input"))


_DOMAIN = re.compile(
    r"^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
)


class NetworkPolicy(_Model):
    """Where a sandbox may connect. Everything else is refused (and counted).

    `domains` are names the sandbox may resolve and reach ("*.example.com"
    covers subdomains); `cidrs` are addresses it may reach without DNS;
    `ports` restricts both (empty: any port); `ecosystems` turn on named
    package sources ({"pypi": True}), mapped to hosts by node configuration.
    """

    domains: list[str] = Field(default_factory=list)
    cidrs: list[str] = Field(default_factory=list)
    ports: list[int] = Field(default_factory=lambda: [80, 443])
    ecosystems: dict[str, bool] = Field(default_factory=dict)

    @field_validator("domains")
    @classmethod
    def _domains(cls, v: list[str]) -> list[str]:
        if len(v) > 256:
            raise ValueError("at most 256 domains")
        out = []
        for d in v:
            d = d.lower().rstrip(".")
            if len(d) > 253 or not _DOMAIN.match(d):
                raise ValueError(f"{d!r} must be a host name, optionally starting with '*.'")
            out.append(d)
        return out

    @field_validator("cidrs")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:
        import ipaddress

        if len(v) > 256:
            raise ValueError("at most 256 CIDRs")
        out = []
        for c in v:
            try:
                net = ipaddress.ip_network(c, strict=False)
            except ValueError:
                raise ValueError(f"{c!r} must be an IPv4 address or CIDR") from None
            if net.version != 4:
                raise ValueError(f"{c!r} must be IPv4 (sandboxes have no IPv6)")
            out.append(str(net))
        return out

    @field_validator("ports")
    @classmethod
    def _ports(cls, v: list[int]) -> list[int]:
        if len(v) > 64 or any(not 1 <= p <= 65535 for p in v):
            raise ValueError("must be at most 64 ports between 1 and 65535")
        return sorted(set(v))


class SandboxState(StrEnum):
    creating = "creating"
    running = "running"
    closing = "closing"
    closed = "closed"
    failed = "failed"
    suspending = "suspending"
    suspended = "suspended"  # a microVM saved to disk; the next request resumes it
    resuming = "resuming"


class CreateSandbox(_Model):
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
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)
    network: NetworkPolicy | None = None  # None: no network at all
    # A retried create with the same key returns the sandbox the first one
    # made, instead of making another (create_many's per-item keys).
    idempotency_key: str | None = None
    # A full VM's screen, (width, height) or "WxH"; default 1024x768.
    display_size: tuple[int, int] | None = None

    @field_validator("display_size", mode="before")
    @classmethod
    def _display_size(cls, v: object, info: Any) -> object:
        if v is not None and info.data.get("kind") != "fullvm":
            raise ValueError(f"is for kind 'fullvm' only, not {info.data.get('kind')!r}")
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

    @field_validator("image", "workspace")
    @classmethod
    def _ref(cls, v: str | None) -> str | None:
        if v is not None and not _REF.match(v):
            raise ValueError("must be a layer reference like 'name:tag' or 'sha256:<64 hex>'")
        return v

    @field_validator("toolkit", mode="before")
    @classmethod
    def _toolkit(cls, v: object) -> object:
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if isinstance(v, list):
            if len(v) > 16:
                raise ValueError("at most 16 toolkit layers")
            for item in v:
                if not isinstance(item, str) or not _REF.match(item):
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
        return _env(v, "env")

    @field_validator("labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > 64:
            raise ValueError("at most 64 labels")
        for k, val in v.items():
            if not _LABEL_KEY.match(k):
                raise ValueError(f"key {k!r} must match [A-Za-z0-9][A-Za-z0-9._/-]{{0,62}}")
            if k == "corral.pool":
                raise ValueError(f"key {k!r} marks the node's own workers")
            if len(val) > 256:
                raise ValueError(f"value of {k!r} must be at most 256 characters")
        return v


class DisplayInput(_Model):
    """One input to a full VM's display: a pointer move or click at (x, y),
    text typed on a US keyboard, or a key combination like 'ctrl+c'."""

    action: Literal["click", "move", "type", "key"]
    x: int | None = None
    y: int | None = None
    button: Literal["left", "middle", "right"] = "left"
    count: int = Field(default=1, ge=1, le=3)  # 2: a double click
    text: str | None = Field(default=None, max_length=4096)
    keys: str | None = Field(default=None, max_length=64)

    @model_validator(mode="after")
    def _complete(self) -> DisplayInput:
        need = {"click": ("x", "y"), "move": ("x", "y"), "type": ("text",), "key": ("keys",)}
        for name in need[self.action]:
            if getattr(self, name) is None:
                raise InvalidArgument(name, f"is required for action {self.action!r}", None)
        return self


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
    workdir: str = "/"
    network: NetworkPolicy | None = None
    address: str | None = None
    display_size: tuple[int, int] | None = None  # a full VM's screen


class ExecRequest(_Model):
    """One command. ``cmd`` as a string runs through the platform's shell."""

    # Bytes travel as base64 in JSON.
    model_config = ConfigDict(extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")

    cmd: str | list[str]
    timeout: float | None = 60.0
    cwd: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    user: str | None = None  # None: the image's user, else root
    stdin: bytes | None = None
    stdout_limit: int = 1 * MiB
    stderr_limit: int = 1 * MiB
    background: bool = False

    @field_validator("cmd")
    @classmethod
    def _cmd(cls, v: str | list[str]) -> str | list[str]:
        parts = [v] if isinstance(v, str) else v
        if not parts or not parts[0]:
            raise ValueError("must be a non-empty command string or argument list")
        if any("\x00" in p for p in parts):
            raise ValueError("must not contain NUL")
        if sum(len(p) for p in parts) > 1 * MiB:
            raise ValueError("must be at most 1 MiB in total")
        return v

    @field_validator("timeout")
    @classmethod
    def _timeout(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v <= 86400:
            raise ValueError("must be a number of seconds above 0 and at most 86400, or null")
        return v

    @field_validator("cwd")
    @classmethod
    def _cwd(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            return check_path(v, "cwd")
        except InvalidArgument as e:
            raise ValueError(e.rule) from None

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        return _env(v, "env")

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        if v is not None and not _USER.match(v):
            raise ValueError("must be a user name, a uid, or uid:gid")
        return v

    @field_validator("stdin")
    @classmethod
    def _stdin(cls, v: bytes | None) -> bytes | None:
        if v is not None and len(v) > 64 * MiB:
            raise ValueError("must be at most 64 MiB")
        return v

    @field_validator("stdout_limit", "stderr_limit")
    @classmethod
    def _limit(cls, v: int) -> int:
        if not 0 <= v <= 256 * MiB:
            raise ValueError("must be between 0 and 256 MiB")
        return v


class ForkRequest(_Model):
    """`n` copies of a running VM sandbox. `idempotency_keys` (one per copy)
    make a retried fork return the copies the first one made."""

    n: int = Field(ge=1, le=32)
    idempotency_keys: list[str] | None = None

    @model_validator(mode="after")
    def _keys(self) -> ForkRequest:
        keys = self.idempotency_keys
        if keys is not None:
            if len(keys) != self.n or len(set(keys)) != self.n:
                raise InvalidArgument(
                    "idempotency_keys", f"must be {self.n} distinct keys, one per copy", len(keys)
                )
            for k in keys:
                if not re.fullmatch(r"[A-Za-z0-9._:-]{1,128}", k):
                    raise InvalidArgument(
                        "idempotency_keys",
                        "must be 1-128 characters of letters, digits and . _ : -",
                        k,
                    )
        return self


class SaveRequest(_Model):
    """Where a VM's saved state goes: an object store's URL (a shared
    directory, http(s):// of `corral blobd`, s3://)."""

    store: str = Field(min_length=1, max_length=1024)


class SavedState(_Model):
    """A VM's state in an object store, restorable on any node with the same
    guest artefacts (kernel and initramfs) that can reach the store."""

    store: str = Field(min_length=1, max_length=1024)
    key: str = Field(pattern=r"^vmstates/[a-z0-9]{1,16}-[0-9a-f]{16}$")
    sandbox: str = ""
    kind: str = ""
    size: int = 0
    guest: str = ""
    # A gateway's key for the restored sandbox's row (as a create's).
    idempotency_key: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._:-]{1,128}$")


class CommitRequest(_Model):
    """Turn a sandbox's writable layer into a new image layer."""

    tag: str
    kind: Literal["base", "workspace", "toolkit", "layer"] = "layer"

    @field_validator("tag")
    @classmethod
    def _tag(cls, v: str) -> str:
        if not _REF.match(v) or v.startswith("sha256:"):
            raise ValueError("must be a tag like 'name:tag'")
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
    dns_denied: int = 0
    disk_used: int | None = None
    disk_limit: int | None = None


class FileEntry(BaseModel):
    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float


class ExecStarted(BaseModel):
    type: Literal["started"] = "started"
    pid: int


class ExecOutput(BaseModel):
    model_config = ConfigDict(ser_json_bytes="base64", val_json_bytes="base64")

    type: Literal["stdout", "stderr"]
    data: bytes


class ExecExit(BaseModel):
    type: Literal["exit"] = "exit"
    exit_code: int
    signal: int = 0
    timed_out: bool = False
    stdout_bytes: int = 0
    stderr_bytes: int = 0
    cpu_user: float = 0.0
    cpu_system: float = 0.0
    max_rss: int = 0
    duration: float = 0.0


ExecEvent = ExecStarted | ExecOutput | ExecExit


# ---------------------------------------------------------------- function calls

FnCallStatus = Literal[
    "ok", "compile_error", "runtime_error", "timeout", "memory_exceeded", "output_limit"
]
_MAX_CODE = 4 * MiB
_MAX_FILES_BYTES = 64 * MiB


def check_call_file_name(name: str) -> str:
    """A call's file lives directly in its work directory: a plain name."""
    if not name or name in (".", "..") or "/" in name or "\x00" in name or len(name) > 255:
        raise ValueError(
            f"file names must be plain names (no '/', not '.' or '..', 1-255 bytes): {name!r}"
        )
    return name


class FnCallRequest(_Model):
    """One stateless call: write the code (and files), compile, run."""

    model_config = ConfigDict(extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")

    language: str
    code: str
    stdin: bytes | None = None
    files: dict[str, bytes] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)
    compile_timeout: float = 10.0
    run_timeout: float = 10.0
    memory: int = 512 * MiB
    output_limit: int = 1 * MiB
    image: str | None = None

    @field_validator("language")
    @classmethod
    def _language(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9_+.#-]{1,32}", v):
            raise ValueError("must be a language name like 'python' or 'cpp'")
        return v

    @field_validator("code")
    @classmethod
    def _code(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        if len(v.encode()) > _MAX_CODE:
            raise ValueError(f"must be at most {_MAX_CODE // MiB} MiB")
        return v

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, bytes]) -> dict[str, bytes]:
        if len(v) > 64:
            raise ValueError("at most 64 files")
        for name in v:
            check_call_file_name(name)
        if sum(len(b) for b in v.values()) > _MAX_FILES_BYTES:
            raise ValueError(f"must hold at most {_MAX_FILES_BYTES // MiB} MiB in total")
        return v

    @field_validator("fetch_files")
    @classmethod
    def _fetch(cls, v: list[str]) -> list[str]:
        if len(v) > 64:
            raise ValueError("at most 64 files")
        return [check_call_file_name(n) for n in v]

    @field_validator("compile_timeout", "run_timeout")
    @classmethod
    def _timeouts(cls, v: float) -> float:
        if not 0 < v <= 300:
            raise ValueError("must be a number of seconds above 0 and at most 300")
        return v

    @field_validator("memory", mode="before")
    @classmethod
    def _memory(cls, v: object) -> int:
        n = parse_size(v, "memory")
        if not 16 * MiB <= n <= 16 * GiB:
            raise ValueError("must be between 16MiB and 16GiB")
        return n

    @field_validator("output_limit", mode="before")
    @classmethod
    def _output(cls, v: object) -> int:
        n = parse_size(v, "output_limit")
        if not 0 < n <= 16 * MiB:
            raise ValueError("must be between 1 byte and 16MiB")
        return n

    @field_validator("stdin")
    @classmethod
    def _stdin(cls, v: bytes | None) -> bytes | None:
        if v is not None and len(v) > 16 * MiB:
            raise ValueError("must be at most 16 MiB")
        return v

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        if v is not None and not _REF.match(v):
            raise ValueError("must be a layer reference like 'name:tag' or 'sha256:<64 hex>'")
        return v


class FnCallStage(_Model):
    """The compile or the run step of a call."""

    exit_code: int | None
    signal: int = 0
    timed_out: bool = False
    stdout: str = ""
    stderr: str = ""
    truncated: bool = False
    wall_time: float = 0.0
    cpu_time: float = 0.0
    peak_memory: int = 0


class FnCallResult(_Model):
    model_config = ConfigDict(extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")

    status: FnCallStatus
    exit_code: int | None
    stdout: str
    stderr: str
    compile_output: str = ""
    wall_time: float
    cpu_time: float
    peak_memory: int
    files: dict[str, bytes] = Field(default_factory=dict)
    compile: FnCallStage | None = None
    run: FnCallStage | None = None
