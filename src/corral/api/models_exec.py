"""Commands in a sandbox: the request, and the events its output streams as
(started, stdout/stderr, exit)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from corral.api.models_base import (
    USER,
    MiB,
    StrictModel,
    check_cpu_class,
    check_env,
    check_path,
)
from corral.errors import InvalidArgument

_KEY = re.compile(r"[A-Za-z0-9._:/-]{1,200}")


class ExecRequest(StrictModel):
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
    # Keep the command's stdin open after `stdin` (if any): more comes with
    # send_stdin(), and EOF with send_stdin(eof=True).
    stdin_open: bool = False
    # Run it on a terminal of (rows, cols): its stdio is the terminal, its
    # output (one stream) comes as stdout, its input through send_stdin,
    # and resize_pty() changes the size. Implies stdin_open.
    pty: tuple[int, int] | None = None
    # At most once per key in a sandbox: the same key again returns the
    # first run's output (node/keyed.py); a rollout's step.
    key: str | None = None
    # The command's CPU class, overriding its sandbox's (None: the
    # sandbox's); containers only (docs/cpu-classes.md).
    cpu_class: str | None = None

    @field_validator("cpu_class")
    @classmethod
    def _cpu_class(cls, v: str | None) -> str | None:
        return None if v is None else check_cpu_class(v)

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

    @field_validator("pty")
    @classmethod
    def _pty(cls, v: tuple[int, int] | None) -> tuple[int, int] | None:
        if v is not None and not all(1 <= n <= 1000 for n in v):
            raise ValueError("must be (rows, cols), each between 1 and 1000")
        return v

    @field_validator("key")
    @classmethod
    def _key(cls, v: str | None) -> str | None:
        if v is not None and not _KEY.fullmatch(v):
            raise ValueError("must be 1-200 letters, digits and . _ : / -")
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
        return check_env(v)

    @field_validator("user")
    @classmethod
    def _user(cls, v: str | None) -> str | None:
        if v is not None and not USER.match(v):
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
