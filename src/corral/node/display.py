"""A desktop sandbox's screen and input, for the runtimes that have one
(runtimes/base.py HasDisplay): the node finds the screen, the runtime
drives it; windows and applications are asked of the desktop inside
(guestdesktop.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path

from corral import metrics
from corral.api import viewtoken
from corral.api.liveview import ViewOpening
from corral.api.models import (
    App,
    DisplayInput,
    DisplayState,
    ExecEvent,
    ExecExit,
    ExecOutput,
    ExecRequest,
    LaunchRequest,
    ViewAccess,
    Window,
)
from corral.errors import Conflict, InvalidArgument
from corral.node import guestdesktop, signing
from corral.node.activity import Activity
from corral.node.store import SandboxRecord
from corral.runtimes.base import HasDisplay, Runtime, Screen
from corral.runtimes.vm.pixels import Region

Awake = Callable[[str], Awaitable[SandboxRecord]]
Exec = Callable[[SandboxRecord, ExecRequest], AsyncIterator[ExecEvent]]
GUEST_TIMEOUT = 120.0  # a TCG guest busy starting an app answers slowly


class Displays:
    def __init__(
        self,
        awake: Awake,
        runtimes: Mapping[str, Runtime],
        activity: Activity,
        exec_: Exec,
        control: Callable[[str], Path],
        *,
        node: str,
        view_key: Path,
    ) -> None:
        self._awake = awake
        self.control = control
        self.runtimes = runtimes
        self.activity = activity
        self._exec = exec_
        self.node = node
        self.view_key = view_key
        # Set by `corral serve`: the views this node issues have a server
        # to be opened on (an embedded node has none).
        self.served = False

    async def _runtime(self, sandbox_id: str) -> tuple[SandboxRecord, HasDisplay]:
        rec = await self._awake(sandbox_id)
        runtime = self.runtimes.get(rec.kind)
        if not isinstance(runtime, HasDisplay) or not rec.spec.get("display_size"):
            raise InvalidArgument(
                "display_size",
                f"was not given: sandbox {sandbox_id} ({rec.kind}) has no display (a fullvm "
                "has one; a container has one when created with display_size)",
                None,
            )
        return rec, runtime

    async def _desktop(self, sandbox_id: str) -> tuple[SandboxRecord, Screen]:
        rec, runtime = await self._runtime(sandbox_id)
        w, h = rec.spec["display_size"]
        return rec, runtime.display(sandbox_id, (int(w), int(h)), self.control(sandbox_id))

    async def view(self, sandbox_id: str, interactive: bool, ttl: int) -> ViewAccess:
        """A token to watch (or, `interactive`, drive) the screen in a
        browser at /view/<token> on this node's server."""
        viewtoken.check_ttl(ttl)
        await self._runtime(sandbox_id)
        if not self.served:
            raise Conflict(
                "a live view is served over HTTP: run the node with `corral serve` "
                "(an embedded node has no server to open it on)"
            )
        key = signing.load_key(self.view_key)
        token, expires = viewtoken.issue(key, sandbox_id, self.node, interactive, ttl)
        metrics.DISPLAY_OPS.labels("view").inc()
        return ViewAccess(
            sandbox_id=sandbox_id, path=f"/view/{token}", token=token,
            interactive=interactive, expires_at=expires,
        )  # fmt: skip

    async def open_view(self, token: str) -> ViewOpening:
        """What a view token grants here, how to open the screen's RFB
        stream (for as long as the token lasts), and how to mark the
        sandbox used when an interactive viewer types or clicks."""
        grant = viewtoken.verify(signing.load_key(self.view_key), token, self.node)
        _, runtime = await self._runtime(grant.sandbox_id)
        control = self.control(grant.sandbox_id)
        seconds = max(1.0, grant.expires_at - time.time() + 5)
        return ViewOpening(
            grant,
            lambda: runtime.open_vnc(grant.sandbox_id, control, seconds),
            lambda: self.activity.touch(grant.sandbox_id),
        )

    async def screenshot(
        self, sandbox_id: str, percent: int = 100, x: int = 0, y: int = 0, width: int = 0,
        height: int = 0,
    ) -> bytes:  # fmt: skip
        """The screen as the machine shows it, a PNG: whole, or the region
        at (x, y) of width x height; at `percent` of its size."""
        _, screen = await self._desktop(sandbox_id)
        region = None
        if width or height or x or y:
            region = Region(x, y, width, height)
        png = await screen.screenshot(percent, region)
        metrics.DISPLAY_OPS.labels("screenshot").inc()
        return png

    async def state(self, sandbox_id: str) -> DisplayState:
        _, screen = await self._desktop(sandbox_id)
        cx, cy = await screen.pointer()
        w, h = screen.size
        return DisplayState(width=w, height=h, cursor_x=cx, cursor_y=cy)

    async def input(self, sandbox_id: str, req: DisplayInput) -> None:
        _, screen = await self._desktop(sandbox_id)
        action = req.action
        if action == "click":
            await screen.click(req.x, req.y, req.button, req.count)
        elif action == "move":
            assert req.x is not None and req.y is not None
            await screen.move(req.x, req.y)
        elif action in ("button_down", "button_up"):
            await screen.button(req.button, action == "button_down", req.x, req.y)
        elif action == "drag":
            assert req.path is not None
            await screen.drag(list(req.path), req.button)
        elif action == "scroll":
            await screen.scroll(req.dx, req.dy, req.x, req.y)
        elif action == "type":
            await screen.type(req.text or "")
        elif action == "key":
            await screen.key(req.keys or "")
        else:
            await screen.hold(req.keys or "", action == "key_down")
        metrics.DISPLAY_OPS.labels(action).inc()
        self.activity.touch(sandbox_id)

    async def _guest(self, rec: SandboxRecord, script: str, *args: str) -> str:
        """Run a platform shell script on the sandbox's desktop; its stdout."""
        req = ExecRequest(
            cmd=["/bin/sh", "-c", script, "sh", *args],
            env=guestdesktop.DISPLAY_ENV,
            user="root",
            timeout=GUEST_TIMEOUT,
            stdout_limit=guestdesktop.OUTPUT_LIMIT,
            stderr_limit=4096,
        )
        out: list[bytes] = []
        err: list[bytes] = []
        code = -1
        async for ev in self._exec(rec, req):
            if isinstance(ev, ExecOutput):
                (out if ev.type == "stdout" else err).append(ev.data)
            elif isinstance(ev, ExecExit):
                code = ev.exit_code
        if code != 0:
            why = b"".join(err).decode(errors="replace").strip()[-300:] or f"exit {code}"
            raise Conflict(f"sandbox {rec.id}: its desktop did not answer: {why}")
        return b"".join(out).decode(errors="replace")

    async def windows(self, sandbox_id: str) -> list[Window]:
        rec, screen = await self._desktop(sandbox_id)
        text = await self._guest(rec, guestdesktop.WINDOWS_SCRIPT)
        metrics.DISPLAY_OPS.labels("windows").inc()
        return guestdesktop.parse_windows(text, screen.size)

    async def apps(self, sandbox_id: str) -> list[App]:
        rec, _ = await self._desktop(sandbox_id)
        return guestdesktop.parse_apps(await self._guest(rec, guestdesktop.APPS_SCRIPT))

    async def launch(self, sandbox_id: str, req: LaunchRequest) -> App:
        rec, _ = await self._desktop(sandbox_id)
        app = guestdesktop.pick_app(await self.apps(sandbox_id), req.app)
        await self._guest(rec, guestdesktop.LAUNCH_SCRIPT, app.command)
        metrics.DISPLAY_OPS.labels("launch").inc()
        self.activity.touch(sandbox_id)
        return app
