"""API keys on the wire: what a key holder asks for (a key for its project
or one below it) and what it is told of a key (never the key, but once)."""

from __future__ import annotations

from pydantic import Field, field_validator

from corral.api.models_base import StrictModel

NOTE_MAX = 200
MAX_LIFE = 100 * 365 * 86400.0  # beyond it, a date is a typo


class CreateKey(StrictModel):
    """A new key for `project` (the caller's own by default, or one of its
    sub-projects), which stops working `expires_in` seconds from now. A
    key that expires cannot make one that outlives it."""

    project: str | None = Field(default=None, min_length=1, max_length=63)
    expires_in: float | None = Field(default=None, gt=0, le=MAX_LIFE)
    note: str = Field(default="", max_length=NOTE_MAX)

    @field_validator("note")
    @classmethod
    def _note(cls, v: str) -> str:
        if not v.isprintable():
            raise ValueError("must be printable (no line breaks or control characters)")
        return v


class ApiKey(StrictModel):
    """A key as listed: its id (the first 12 hex digits of its hash), whose
    it is, its life, and which key made it. `api_key` is the key itself, in
    the answer to its creation only."""

    id: str
    project: str
    created_at: float
    expires_at: float | None = None
    revoked_at: float | None = None
    last_used_at: float | None = None
    note: str = ""
    created_by: str | None = None  # the id of the key that made it (None: the operator's CLI)
    api_key: str | None = None
    # In a revocation's answer: the keys made from it, revoked with it.
    also_revoked: list[str] = []
