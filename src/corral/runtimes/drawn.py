"""Ready means drawn: a desktop sandbox's create returns once its desktop
is on the screen, for a full VM (its guest's init starts the session) and
for a container desktop (the node starts it).

The image's session writes desktop.DRAWN_PATH when its first windows are
mapped; then the screen must show more than one colour and hold still
(two frames SETTLE_GAP apart the same, for at most SETTLE_MAX: a clock
never settles and need not). Whatever never comes within DRAWN_TIMEOUT is
named in the error, with the tail of the session's log.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

from corral.errors import CorralError, FileNotFound, SandboxFailed
from corral.execd.client import ExecdClient
from corral.log import get_logger
from corral.runtimes.vm import desktop, pixels

log = get_logger("corral.drawn")

DRAWN_TIMEOUT = 180.0  # TCG, a loaded host, several full desktops booting at once
SETTLE_GAP = 0.25  # s between the frames that must match for a desktop to be drawn
SETTLE_MAX = 5.0  # s a desktop may keep changing before it counts as drawn anyway
SESSION_LOG = "/tmp/corral-session.log"


class Framed(Protocol):
    async def frame(self) -> pixels.Rgb: ...


async def has(sandbox_id: str, client: ExecdClient, path: str, deadline: float) -> bool:
    """Whether the sandbox has `path`. A guest starting its desktop under a
    loaded host may drop one agent connection (its channel resets the
    streams it had): that is asked again, until `deadline`, rather than
    failing the create."""
    while True:
        try:
            await client.stat("root", path)
            return True
        except FileNotFound:
            return False
        except ConnectionError as exc:
            if asyncio.get_running_loop().time() >= deadline:
                raise
            log.warning("drawn.retry", sandbox=sandbox_id, path=path, error=str(exc))
            await asyncio.sleep(0.2)


async def wait(
    sandbox_id: str, client: ExecdClient, screen: Framed, timeout: float = DRAWN_TIMEOUT
) -> None:
    """Until the session has said it drew and the screen shows it."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    said = False
    while loop.time() < deadline:
        if not said:
            said = await has(sandbox_id, client, desktop.DRAWN_PATH, deadline)
        if said:
            frame = await screen.frame()
            if pixels.distinct_colours(frame, 2) >= 2:
                await _settle(screen, frame.data)
                return
        await asyncio.sleep(0.05)
    x_log = ""
    with contextlib.suppress(Exception):
        tail = await client.read("root", SESSION_LOG, 1 << 16)
        x_log = " | ".join(tail.decode(errors="replace").strip().splitlines()[-5:])
    what = "the screen stayed one colour" if said else f"{desktop.DRAWN_PATH} never appeared"
    raise SandboxFailed(
        f"sandbox {sandbox_id}: its desktop ({desktop.SESSION_PATH}) never came up within "
        f"{timeout:.0f}s: {what}; session log: {x_log or 'empty'}",
        sandbox=sandbox_id,
    )


class Answering(Framed, Protocol):
    async def pointer(self) -> tuple[int, int]: ...


async def still_drawn(sandbox_id: str, screen: Answering) -> None:
    """A desktop drawn earlier (a warm one, node/warmpool.py) still shows
    something: its X server answers (asked where the pointer is: Xvfb's
    screen file outlives Xvfb, so a frame alone proves nothing) and the
    screen is not one colour. SandboxFailed if not (its session died while
    it waited)."""
    try:
        await screen.pointer()
        frame = await screen.frame()
    except (CorralError, OSError) as exc:
        raise SandboxFailed(
            f"sandbox {sandbox_id}: its desktop no longer answers ({exc})", sandbox=sandbox_id
        ) from None
    if pixels.distinct_colours(frame, 2) < 2:
        raise SandboxFailed(
            f"sandbox {sandbox_id}: its desktop shows one colour", sandbox=sandbox_id
        )


async def _settle(screen: Framed, last: bytes) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_MAX
    while loop.time() < deadline:
        await asyncio.sleep(SETTLE_GAP)
        now = (await screen.frame()).data
        if now == last:
            return
        last = now


# Rows a frame may differ by and still count as the same screen: a text
# cursor blinking (a 16-row cell) is not a screen that is still drawing.
STILL_ROWS = 24


async def wait_still(sandbox_id: str, screen: Framed, quiet: float, timeout: float) -> None:
    """Until the screen shows more than one colour and has not changed
    (but for a blinking cursor) for `quiet` seconds: all a screen says
    when nothing inside the guest can (a user's own disk, no agent)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: pixels.Rgb | None = None
    since = loop.time()
    colours = 0
    while loop.time() < deadline:
        frame = await screen.frame()
        now = loop.time()
        if last is None or pixels.rows_changed(frame, last) > STILL_ROWS:
            last, since = frame, now
            colours = pixels.distinct_colours(frame, 2)
        elif colours >= 2 and now - since >= quiet:
            return
        await asyncio.sleep(SETTLE_GAP)
    what = "it showed one colour" if colours < 2 else "it kept changing"
    raise SandboxFailed(
        f"sandbox {sandbox_id}: its screen never held still for {quiet:.0f}s with something "
        f"drawn on it within {timeout:.0f}s ({what})",
        sandbox=sandbox_id,
    )
