"""A rollout's log on the wire: its steps, each a call and its result."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import Field, field_validator

from corral.api.models_base import MiB, StrictModel

ROLLOUT_NAME = re.compile(r"[A-Za-z0-9._:-]{1,128}")
ROLLOUT_NAME_RULE = "must be 1-128 letters, digits and . _ : -"
MAX_STEP_RESULT = 16 * MiB  # one logged result, as JSON


class RolloutStep(StrictModel):
    """Step `step` of a rollout: which call (`op`), a digest of its
    arguments (a replay with other arguments is refused), and its result
    as JSON."""

    step: int = Field(ge=0, le=10_000_000)
    op: str = Field(min_length=1, max_length=64)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    result: Any = None
    at: float = 0.0  # when it was logged (the store's clock), set by the store

    @field_validator("result")
    @classmethod
    def _result(cls, v: Any) -> Any:
        if len(json.dumps(v)) > MAX_STEP_RESULT:
            raise ValueError(f"must be at most {MAX_STEP_RESULT} bytes as JSON")
        return v
