"""A desktop sandbox's screen, pointer and keyboard: what a GUI agent sees
and does (docs/display.md maps Anthropic's and OpenAI's computer-use
actions to these calls)."""

from __future__ import annotations

import asyncio

from corral.api.models import (
    App,
    DisplayInput,
    DisplayState,
    LaunchRequest,
    ViewAccess,
    Window,
    validated,
)
from corral.errors import InvalidArgument
from corral.sdk.handle import SandboxHandle

MAX_WAIT = 60.0


class AsyncDisplay:
    """Of a `fullvm` sandbox; other kinds answer InvalidArgument.

    Where (x, y) is optional, leaving both out acts where the pointer is."""

    def __init__(self, sandbox: SandboxHandle) -> None:
        self._sandbox = sandbox

    @property
    def size(self) -> tuple[int, int] | None:
        """(width, height) of the screen; None for a sandbox without one."""
        return self._sandbox.info.display_size

    async def screenshot(
        self, *, scale: float = 1.0, region: tuple[int, int, int, int] | None = None
    ) -> bytes:
        """The screen as the VM shows it now, PNG bytes; only `region`
        (x, y, width, height) of it if given; `scale` (0.05..1) times its
        size (nearest pixel), so an agent can see a 1280x800 screen at
        the size its model takes."""
        percent = round(scale * 100)
        if not 0.05 <= scale <= 1 or not 5 <= percent <= 100:
            raise InvalidArgument("scale", "must be between 0.05 and 1 (1: full size)", scale)
        x, y, width, height = region if region is not None else (0, 0, 0, 0)
        if region is not None and (width <= 0 or height <= 0):
            raise InvalidArgument("region", "must be (x, y, width, height), both sizes > 0", region)
        return await self._sandbox._service.screenshot(
            self._sandbox.id, percent, x, y, width, height
        )

    async def state(self) -> DisplayState:
        """The screen's size and the pointer's position."""
        return await self._sandbox._service.display_state(self._sandbox.id)

    async def cursor(self) -> tuple[int, int]:
        """Where the pointer is (where Corral last put it: the tablet is
        absolute, so only a program warping its own cursor moves it)."""
        st = await self.state()
        return st.cursor_x, st.cursor_y

    async def click(
        self,
        x: int | None = None,
        y: int | None = None,
        *,
        button: str = "left",
        count: int = 1,
    ) -> None:
        """Click at (x, y) (count=2: double, 3: triple click); `button`
        is left, middle, right, wheel (middle), back or forward."""
        await self._send({"action": "click", "x": x, "y": y, "button": button, "count": count})

    async def double_click(self, x: int | None = None, y: int | None = None) -> None:
        await self.click(x, y, count=2)

    async def triple_click(self, x: int | None = None, y: int | None = None) -> None:
        await self.click(x, y, count=3)

    async def right_click(self, x: int | None = None, y: int | None = None) -> None:
        await self.click(x, y, button="right")

    async def middle_click(self, x: int | None = None, y: int | None = None) -> None:
        await self.click(x, y, button="middle")

    async def move(self, x: int, y: int) -> None:
        """Move the pointer to (x, y) without clicking."""
        await self._send({"action": "move", "x": x, "y": y})

    async def mouse_down(
        self, x: int | None = None, y: int | None = None, *, button: str = "left"
    ) -> None:
        """Press `button` and keep it pressed (a drag's start)."""
        await self._send({"action": "button_down", "x": x, "y": y, "button": button})

    async def mouse_up(
        self, x: int | None = None, y: int | None = None, *, button: str = "left"
    ) -> None:
        """Release `button` (a drag's end)."""
        await self._send({"action": "button_up", "x": x, "y": y, "button": button})

    async def drag(self, path: list[tuple[int, int]], *, button: str = "left") -> None:
        """Press at path[0], move through the points, release at the last."""
        await self._send({"action": "drag", "path": path, "button": button})

    async def scroll(
        self, dy: int = 0, dx: int = 0, *, x: int | None = None, y: int | None = None
    ) -> None:
        """Turn the wheel `dy` notches down (negative: up) and `dx` right
        (negative: left), at (x, y) or where the pointer is."""
        await self._send({"action": "scroll", "dx": dx, "dy": dy, "x": x, "y": y})

    async def type(self, text: str) -> None:
        """Type `text` on a US keyboard ('\\n' is Enter)."""
        await self._send({"action": "type", "text": text})

    async def key(self, keys: str) -> None:
        """Press a key or a combination, like 'enter' or 'ctrl+c'."""
        await self._send({"action": "key", "keys": keys})

    async def key_down(self, keys: str) -> None:
        """Press the keys of a combination ('shift', 'ctrl+alt') and hold them."""
        await self._send({"action": "key_down", "keys": keys})

    async def key_up(self, keys: str) -> None:
        """Release keys held with key_down."""
        await self._send({"action": "key_up", "keys": keys})

    async def wait(self, seconds: float) -> None:
        """Let the screen settle (computer-use tools' `wait`); at most a minute."""
        if not 0 <= seconds <= MAX_WAIT:
            raise InvalidArgument("seconds", f"must be 0..{MAX_WAIT:.0f}", seconds)
        await asyncio.sleep(seconds)

    async def windows(self) -> list[Window]:
        """The windows the desktop shows: id, title and geometry."""
        return await self._sandbox._service.display_windows(self._sandbox.id)

    async def apps(self) -> list[App]:
        """The applications installed in the desktop image."""
        return await self._sandbox._service.display_apps(self._sandbox.id)

    async def launch(self, app: str) -> App:
        """Start an installed application (by id, name or program, any
        case); returns what was started. Its window appears when it has
        drawn it: wait for it in `windows()`."""
        req = validated(LaunchRequest, {"app": app})
        return await self._sandbox._service.display_launch(self._sandbox.id, req)

    async def view(self, *, interactive: bool = False, ttl: int = 300) -> ViewAccess:
        """A live view of the screen for a browser: `url` (the server's
        /view/<token> page, noVNC) until `expires_at`; read-only unless
        `interactive`. Needs a server (`corral serve`)."""
        access = await self._sandbox._service.display_view(self._sandbox.id, interactive, ttl)
        base = getattr(self._sandbox._service, "url", None)
        if isinstance(base, str):
            access = access.model_copy(update={"url": base.rstrip("/") + access.path})
        return access

    async def _send(self, fields: dict[str, object]) -> None:
        req = validated(DisplayInput, {k: v for k, v in fields.items() if v is not None})
        await self._sandbox._service.display_input(self._sandbox.id, req)
