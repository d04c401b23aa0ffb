"""A full VM's screen, pointer and keyboard: what a GUI agent sees and does."""

from __future__ import annotations

from corral.api.models import DisplayInput, validated
from corral.sdk.handle import SandboxHandle


class AsyncDisplay:
    """Of a `fullvm` sandbox; other kinds answer InvalidArgument."""

    def __init__(self, sandbox: SandboxHandle) -> None:
        self._sandbox = sandbox

    @property
    def size(self) -> tuple[int, int] | None:
        """(width, height) of the screen; None for a sandbox without one."""
        return self._sandbox.info.display_size

    async def screenshot(self) -> bytes:
        """The screen as the VM shows it now, PNG bytes."""
        return await self._sandbox._service.screenshot(self._sandbox.id)

    async def click(self, x: int, y: int, *, button: str = "left", count: int = 1) -> None:
        """Move the pointer to (x, y) and click (count=2: double click)."""
        await self._send({"action": "click", "x": x, "y": y, "button": button, "count": count})

    async def move(self, x: int, y: int) -> None:
        """Move the pointer to (x, y) without clicking."""
        await self._send({"action": "move", "x": x, "y": y})

    async def type(self, text: str) -> None:
        """Type `text` on a US keyboard ('\\n' is Enter)."""
        await self._send({"action": "type", "text": text})

    async def key(self, keys: str) -> None:
        """Press a key or a combination, like 'enter' or 'ctrl+c'."""
        await self._send({"action": "key", "keys": keys})

    async def _send(self, fields: dict[str, object]) -> None:
        req = validated(DisplayInput, fields)
        await self._sandbox._service.display_input(self._sandbox.id, req)
