"""SandboxFusion's `run_code` endpoint over Corral's function calls.

Tools written for ByteDance's SandboxFusion (its `sandbox-fusion` client,
verl's SandboxFusionTool) post a RunCodeRequest to `<endpoint>/run_code`;
pointing them at `corral serve` runs the code as a Corral function call.
The wire shapes below follow SandboxFusion's published schema; statuses map
as: ok -> Success, anything else -> Failed (with `message` saying which);
a compile step that timed out, or a run that did, is TimeLimitExceeded.
"""

from __future__ import annotations

import base64
import binascii
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from corral.api.models import FnCallRequest, FnCallResult, FnCallStage, validated
from corral.api.models_base import MiB
from corral.errors import InvalidArgument

# SandboxFusion's language names where they differ from Corral's.
LANGUAGE_NAMES = {"python3": "python"}


class RunCodeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    compile_timeout: float = 10
    run_timeout: float = 10
    code: str
    stdin: str | None = None
    language: str
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)
    # SandboxFusion's name; -1, its default, sets no limit of the call's own.
    memory_limit_MB: int = -1


class CommandRunResult(BaseModel):
    status: Literal["Finished", "Error", "TimeLimitExceeded"]
    execution_time: float | None = None
    cpu_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    status: Literal["Success", "Failed", "SandboxError"]
    message: str
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


def to_call(req: RunCodeRequest) -> FnCallRequest:
    files: dict[str, bytes] = {}
    for name, data in req.files.items():
        if data is None:
            continue
        try:
            files[name] = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgument(f"files.{name}", "must be base64", data[:64]) from None
    limit = req.memory_limit_MB
    if limit != -1 and not 16 <= limit <= 16384:
        raise InvalidArgument("memory_limit_MB", "must be -1 or between 16 and 16384", limit)
    return validated(
        FnCallRequest,
        {
            "language": LANGUAGE_NAMES.get(req.language, req.language),
            "code": req.code,
            "stdin": req.stdin.encode() if req.stdin is not None else None,
            "files": files,
            "fetch_files": req.fetch_files,
            "compile_timeout": req.compile_timeout,
            "run_timeout": req.run_timeout,
            **({"memory": limit * MiB} if limit != -1 else {}),
        },
    )


def _stage(stage: FnCallStage | None) -> CommandRunResult | None:
    if stage is None:
        return None
    return CommandRunResult(
        status="TimeLimitExceeded" if stage.timed_out else "Finished",
        execution_time=round(stage.wall_time, 6),
        cpu_time=round(stage.cpu_time, 6),
        return_code=None if stage.timed_out else stage.exit_code,
        stdout=stage.stdout,
        stderr=stage.stderr,
    )


def from_result(result: FnCallResult, worker: str | None = None) -> RunCodeResponse:
    return RunCodeResponse(
        status="Success" if result.status == "ok" else "Failed",
        message="" if result.status == "ok" else result.status,
        compile_result=_stage(result.compile),
        run_result=_stage(result.run),
        executor_pod_name=worker,
        files={k: base64.b64encode(v).decode() for k, v in result.files.items()},
    )
