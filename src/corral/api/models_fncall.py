"""Stateless function calls: the request (code, files, limits) and the
verdict of its compile and run steps."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from corral.api.models_base import REF, REF_RULE, GiB, MiB, StrictModel
from corral.units import parse_size

FnCallStatus = Literal[
    "ok", "compile_error", "runtime_error", "timeout", "memory_exceeded", "output_limit"
]
_MAX_CODE = 4 * MiB
_MAX_FILES_BYTES = 64 * MiB


def check_call_file_name(name: str) -> str:
    """A call's file, relative to its work directory: "a.txt" or
    "dir1/dir2/secret_flag" (SandboxFusion's `files`), never absolute and
    never escaping it with '..'."""
    parts = name.split("/")
    if (
        not name
        or name.startswith("/")
        or "\x00" in name
        or len(name) > 1024
        or any(p in ("", ".", "..") or len(p) > 255 for p in parts)
        or len(parts) > 16
    ):
        raise ValueError(
            "file names must be relative paths inside the work directory (no leading '/', "
            f"no '.', '..' or empty parts, at most 16 parts of 1-255 bytes): {name!r}"
        )
    return name


def check_fetch_path(path: str) -> str:
    """A file to bring back: relative to the work directory, or absolute
    (anywhere the call's user may read)."""
    if not path or "\x00" in path or len(path) > 1024 or path.endswith("/"):
        raise ValueError(f"fetch_files entries must be file paths of 1-1024 bytes: {path!r}")
    return path


class FnCallRequest(StrictModel):
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
    # The caller's project, set by a gateway (a caller's own value is
    # replaced): a node runs no call on a layer another project committed.
    project: str | None = None

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
        names = set(v)
        for name in v:  # "a" and "a/b": one cannot be both a file and a directory
            parts = name.split("/")
            for i in range(1, len(parts)):
                if "/".join(parts[:i]) in names:
                    raise ValueError(f"{'/'.join(parts[:i])!r} is a file and a directory")
        if sum(len(b) for b in v.values()) > _MAX_FILES_BYTES:
            raise ValueError(f"must hold at most {_MAX_FILES_BYTES // MiB} MiB in total")
        return v

    @field_validator("fetch_files")
    @classmethod
    def _fetch(cls, v: list[str]) -> list[str]:
        if len(v) > 64:
            raise ValueError("at most 64 files")
        return [check_fetch_path(n) for n in v]

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
        if v is not None and not REF.match(v):
            raise ValueError(REF_RULE)
        return v


class FnCallStage(StrictModel):
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


class FnCallResult(StrictModel):
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
    # The worker that ran it (SandboxFusion's executor_pod_name): which one
    # to look at when a verdict is in doubt.
    worker: str | None = None
