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
import json
from typing import Any, Literal

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


class RunJupyterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    cells: list[str]
    cell_timeout: float = 0  # 0: only total_timeout bounds a cell
    total_timeout: float = 45
    memory_limit_MB: int = -1
    kernel: str = "python3"
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


class CellRunResult(BaseModel):
    stdout: str
    stderr: str
    display: list[dict[str, Any]]
    error: list[dict[str, Any]]


class RunJupyterResponse(BaseModel):
    status: Literal["Success", "Failed", "SandboxError"]
    message: str
    driver: CommandRunResult | None = None
    cells: list[CellRunResult] = Field(default_factory=list)
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


# A Jupyter call's own time past its cells' (the kernel's answer, the files).
JUPYTER_SLACK = 10.0
MAX_CELLS = 256


def _files(files: dict[str, str | None]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name, data in files.items():
        if data is None:
            continue
        try:
            out[name] = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgument(f"files.{name}", "must be base64", data[:64]) from None
    return out


def _memory(limit: int) -> dict[str, int]:
    if limit != -1 and not 16 <= limit <= 16384:
        raise InvalidArgument("memory_limit_MB", "must be -1 or between 16 and 16384", limit)
    return {"memory": limit * MiB} if limit != -1 else {}


def to_jupyter_call(req: RunJupyterRequest) -> FnCallRequest:
    """The cells as a call in the `jupyter` language (its warm kernel)."""
    if req.kernel != "python3":
        raise InvalidArgument("kernel", "must be python3 (the only kernel served)", req.kernel)
    if not 1 <= len(req.cells) <= MAX_CELLS:
        raise InvalidArgument("cells", f"must hold 1 to {MAX_CELLS} cells", len(req.cells))
    most = 300 - JUPYTER_SLACK
    if not 0 < req.total_timeout <= most:
        raise InvalidArgument(
            "total_timeout", f"must be above 0 and at most {most:.0f} s", req.total_timeout
        )
    if not 0 <= req.cell_timeout <= req.total_timeout:
        raise InvalidArgument(
            "cell_timeout", "must be 0 (none) or at most total_timeout", req.cell_timeout
        )
    doc = {"cells": req.cells, "cell_timeout": req.cell_timeout, "total_timeout": req.total_timeout}
    return validated(
        FnCallRequest,
        {
            "language": "jupyter",
            "code": json.dumps(doc),
            "files": _files(req.files),
            "fetch_files": req.fetch_files,
            "run_timeout": req.total_timeout + JUPYTER_SLACK,
            **_memory(req.memory_limit_MB),
        },
    )


def from_jupyter_result(result: FnCallResult) -> RunJupyterResponse:
    worker = result.worker
    files = {k: base64.b64encode(v).decode() for k, v in result.files.items()}
    driver = _stage(result.run)
    try:
        doc = json.loads(result.stdout) if result.status == "ok" else None
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or doc.get("status") not in ("Finished", "TimeLimitExceeded"):
        # The kernel died, or the call ran past its own time: the driver says which.
        why = result.status if result.status != "ok" else "the kernel gave no answer"
        return RunJupyterResponse(
            status="Failed", message=why, driver=driver, executor_pod_name=worker, files=files
        )
    cells = [CellRunResult.model_validate(c) for c in doc.get("cells", [])]
    if driver is not None:
        driver.stdout = ""  # it was the cells' document: said once, in `cells`
    if doc["status"] == "TimeLimitExceeded":
        t = doc.get("timed_out", {})
        if driver is not None:
            driver.status = "TimeLimitExceeded"
        return RunJupyterResponse(
            status="Failed",
            message=f"cells[{t.get('cell')}] ran past {t.get('field')} "
            f"(the cells must finish within {t.get('limit', 0):.3g} s); it was interrupted",
            driver=driver,
            cells=cells,
            executor_pod_name=worker,
            files=files,
        )
    return RunJupyterResponse(
        status="Success",
        message="",
        driver=driver,
        cells=cells,
        executor_pod_name=worker,
        files=files,
    )


def to_call(req: RunCodeRequest) -> FnCallRequest:
    return validated(
        FnCallRequest,
        {
            "language": LANGUAGE_NAMES.get(req.language, req.language),
            "code": req.code,
            "stdin": req.stdin.encode() if req.stdin is not None else None,
            "files": _files(req.files),
            "fetch_files": req.fetch_files,
            "compile_timeout": req.compile_timeout,
            "run_timeout": req.run_timeout,
            **_memory(req.memory_limit_MB),
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


def from_result(result: FnCallResult) -> RunCodeResponse:
    return RunCodeResponse(
        status="Success" if result.status == "ok" else "Failed",
        message="" if result.status == "ok" else result.status,
        compile_result=_stage(result.compile),
        run_result=_stage(result.run),
        executor_pod_name=result.worker,
        files={k: base64.b64encode(v).decode() for k, v in result.files.items()},
    )
