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


STORE_NAME = r"^[a-z0-9][a-z0-9_-]{0,31}$"


class SaveRequest(StrictModel):
    """Where a VM's saved state goes: one of the object stores the node's
    operator named (NodeConfig.stores; "local" is always one), never a
    path or URL of the caller's choosing."""

    store: str = Field(default="local", pattern=STORE_NAME)


class SavedState(StrictModel):
    """A VM's state in a named object store, restorable on any node with the
    same guest artefacts (kernel and initramfs) that has that store. Its
    size and project come from save(): a node refuses a restore whose
    values differ from the signed record's (a gateway charges by them)."""

    store: str = Field(default="local", pattern=STORE_NAME)
    key: str = Field(pattern=r"^vmstates/[a-z0-9]{1,16}-[0-9a-f]{16}$")
    sandbox: str = ""
    kind: str = ""
    size: int = 0
    guest: str = ""
    cpu: float = Field(default=0.0, ge=0)
    memory: int = Field(default=0, ge=0)
    project: str | None = Field(default=None, max_length=64)
    # A gateway's key for the restored sandbox's row (as a create's).
    idempotency_key: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._:-]{1,128}$")
