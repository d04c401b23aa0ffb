"""A desktop sandbox's screen and input, for the runtimes that have one
(runtimes/base.py HasDisplay): the node finds the screen, the runtime
drives it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from corral import metrics
from corral.api.models import DisplayInput
from corral.errors import InvalidArgument
from corral.node.activity import Activity
from corral.node.store import SandboxRecord
from corral.runtimes.base import HasDisplay, Runtime, Screen

Awake = Callable[[str], Awaitable[SandboxRecord]]


class Displays:
    def __init__(self, awake: Awake, runtimes: Mapping[str, Runtime], activity: Activity) -> None:
        self._awake = awake
        self.runtimes = runtimes
        self.activity = activity

    async def _screen(self, sandbox_id: str) -> Screen:
        rec = await self._awake(sandbox_id)
        runtime = self.runtimes.get(rec.kind)
        if not isinstance(runtime, HasDisplay):
            raise InvalidArgument(
                "kind", "has no display: only fullvm sandboxes have one", rec.kind
            )
        w, h = rec.spec["display_size"]
        return runtime.display(sandbox_id, (int(w), int(h)))

    async def screenshot(self, sandbox_id: str) -> bytes:
        """The screen as the machine shows it, a PNG."""
        png = await (await self._screen(sandbox_id)).screenshot()
        metrics.DISPLAY_OPS.labels("screenshot").inc()
        return png

    async def input(self, sandbox_id: str, req: DisplayInput) -> None:
        screen = await self._screen(sandbox_id)
        if req.action == "click":
            assert req.x is not None and req.y is not None
            await screen.click(req.x, req.y, req.button, req.count)
        elif req.action == "move":
            assert req.x is not None and req.y is not None
            await screen.move(req.x, req.y)
        elif req.action == "type":
            await screen.type(req.text or "")
        else:
            await screen.key(req.keys or "")
        metrics.DISPLAY_OPS.labels(req.action).inc()
        self.activity.touch(sandbox_id)
