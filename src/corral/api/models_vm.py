"""What only VM sandboxes do: fork, save and restore their state, and a
full VM's display input."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, model_validator

from corral.api.models_base import StrictModel
from corral.errors import InvalidArgument

DisplayAction = Literal[
    "click", "move", "button_down", "button_up", "drag", "scroll",
    "type", "key", "key_down", "key_up",
]  # fmt: skip
Button = Literal["left", "middle", "right", "wheel", "back", "forward"]


class DisplayInput(StrictModel):
    """One input to a desktop sandbox's display (docs/display.md):

    - click: at (x, y), or where the pointer is; `count` 2 is a double
      click, 3 a triple click; any `button`;
    - move: the pointer to (x, y);
    - button_down / button_up: press or release `button` (at (x, y) if
      given): the parts of a drag an agent times itself;
    - drag: press at `path`'s first point, move through it, release;
    - scroll: `dy` wheel notches down (negative: up), `dx` right
      (negative: left), at (x, y) if given;
    - type: `text` typed on a US keyboard;
    - key: a combination like 'ctrl+c' pressed and released;
    - key_down / key_up: hold the keys of a combination, or let them go.
    """

    action: DisplayAction
    x: int | None = None
    y: int | None = None
    button: Button = "left"
    count: int = Field(default=1, ge=1, le=3)
    path: list[tuple[int, int]] | None = Field(default=None, min_length=2, max_length=64)
    dx: int = Field(default=0, ge=-50, le=50)
    dy: int = Field(default=0, ge=-50, le=50)
    text: str | None = Field(default=None, max_length=4096)
    keys: str | None = Field(default=None, max_length=64)

    @model_validator(mode="after")
    def _complete(self) -> DisplayInput:
        need: dict[str, tuple[str, ...]] = {
            "move": ("x", "y"), "drag": ("path",), "type": ("text",),
            "key": ("keys",), "key_down": ("keys",), "key_up": ("keys",),
        }  # fmt: skip
        for name in need.get(self.action, ()):
            if getattr(self, name) is None:
                raise InvalidArgument(name, f"is required for action {self.action!r}", None)
        if (self.x is None) != (self.y is None):
            missing = "x" if self.x is None else "y"
            raise InvalidArgument(missing, "must be given with the other coordinate", None)
        if self.action == "scroll" and self.dx == 0 and self.dy == 0:
            raise InvalidArgument("dy", "or dx must be non-zero for action 'scroll'", 0)
        return self


class DisplayState(StrictModel):
    """A display's size and where Corral last put the pointer."""

    width: int
    height: int
    cursor_x: int
    cursor_y: int


class Window(StrictModel):
    """A top-level window the window manager shows: its X id, title and
    geometry in screen pixels (the client area, without decorations)."""

    id: str
    title: str
    x: int
    y: int
    width: int
    height: int


class App(StrictModel):
    """An application installed in the desktop image (a desktop entry in
    /usr/share/applications): `id` is the entry's file name without
    `.desktop`, `name` its Name, `command` its Exec without field codes."""

    id: str
    name: str
    command: str


class ViewAccess(StrictModel):
    """A live view of a desktop sandbox's screen: open `path` (with
    `token` in it) on the server that issued it, in a browser, until
    `expires_at` (Unix seconds). Read-only unless `interactive`."""

    sandbox_id: str
    path: str
    token: str
    interactive: bool
    expires_at: float
    # The page's full address, filled in by an SDK talking to a server
    # (the server does not know the address its callers reach it by).
    url: str | None = None


class LaunchRequest(StrictModel):
    """Start an installed application by its id, its name or its command's
    program name (any case)."""

    app: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9 ._+-]*$")


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
