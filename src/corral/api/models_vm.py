"""What only VM sandboxes do: fork, save and restore their state, and a
full VM's display input."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from corral.api.models_base import StrictModel
from corral.errors import InvalidArgument


class DisplayInput(StrictModel):
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


class ForkRequest(StrictModel):
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


class SaveRequest(StrictModel):
    """Where a VM's saved state goes: an object store's URL (a shared
    directory, http(s):// of `corral blobd`, s3://)."""

    store: str = Field(min_length=1, max_length=1024)


class SavedState(StrictModel):
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
