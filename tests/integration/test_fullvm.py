"""A full VM's display, driven the way a GUI agent drives it.

The default desktop image (install script: `corral image build
debian-desktop:bookworm --desktop`) boots X with twm and a "Terminal"
launcher. The test finds the launcher in a screenshot, clicks it, clicks
into the terminal that opens, types a command, and reads the command's
effect off the screen's pixels: the whole loop an agent runs, on real
pixels, with no help from inside the guest.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest

import corral
from corral.runtimes.vm import desktop

from ..framework import png_pixels, require_image

GREEN = (0, 255, 0)


@pytest.fixture
async def desk(embedded: corral.AsyncClient) -> AsyncIterator[corral.AsyncSandbox]:
    require_image(desktop.BASE)
    s = await embedded.sandboxes.create(
        kind="fullvm", image=desktop.BASE, toolkit=[desktop.TOOLKIT], memory="1GiB"
    )
    yield s
    await s.close()


def _pixel(rows: list[bytes], x: int, y: int) -> tuple[int, int, int]:
    r, g, b = rows[y][3 * x : 3 * x + 3]
    return r, g, b


def _box(
    rows: list[bytes], x0: int, y0: int, x1: int, y1: int, bg: tuple[int, int, int]
) -> tuple[int, int, int, int] | None:
    """Bounding box of the pixels that are not the background in a region."""
    xs, ys = [], []
    for y in range(y0, y1):
        for x in range(x0, x1):
            if _pixel(rows, x, y) != bg:
                xs.append(x)
                ys.append(y)
    return (min(xs), min(ys), max(xs), max(ys)) if xs else None


async def _wait_screen(
    sbx: corral.AsyncSandbox, ok: Callable[[list[bytes]], object], what: str, timeout: float = 120
) -> list[bytes]:
    deadline = time.monotonic() + timeout
    while True:
        w, h, rows = png_pixels(await sbx.display.screenshot())
        assert (w, h) == sbx.display.size
        if ok(rows):
            return rows
        assert time.monotonic() < deadline, f"the screen never showed {what}"
        await asyncio.sleep(1)


@pytest.mark.requires_qemu
async def test_open_a_terminal_by_clicking_type_and_read_the_screen(
    desk: corral.AsyncSandbox,
) -> None:
    assert desk.display.size == (1024, 768)
    bg = desktop.DESKTOP_RGB
    # The desktop is up when its background fills the screen and the
    # launcher sits in the top-left corner.
    rows = await _wait_screen(
        desk,
        lambda rows: _pixel(rows, 900, 700) == bg and _box(rows, 0, 0, 160, 100, bg),
        "the desktop",
    )
    box = _box(rows, 0, 0, 160, 100, bg)
    assert box is not None
    x0, y0, x1, y1 = box
    # The launcher is xmessage: a label above one button; click the button.
    await desk.display.click((x0 + x1) // 2, y1 - (y1 - y0) // 4)
    rows = await _wait_screen(
        desk, lambda rows: _box(rows, 300, 150, 500, 250, bg) is not None, "a terminal window"
    )
    # twm focuses the window under the pointer.
    await desk.display.click(400, 200)
    await desk.display.type("echo corral-$((6*7)) > /tmp/typed; xsetroot -solid '#00ff00'\n")
    await _wait_screen(
        desk, lambda rows: _pixel(rows, 900, 700) == GREEN, "the typed command's effect"
    )
    assert await desk.files.read("/tmp/typed") == b"corral-42\n"
    # Keys: ctrl+c interrupts what runs in the focused terminal.
    await desk.display.type("sleep 600; xsetroot -solid '#ff0000'\n")
    await asyncio.sleep(2)
    await desk.display.key("ctrl+c")
    await desk.display.type("xsetroot -solid '#0000ff'\n")
    await _wait_screen(
        desk, lambda rows: _pixel(rows, 900, 700) == (0, 0, 255), "blue after ctrl+c"
    )
    # Bad input is refused by name, before QEMU hears of it.
    with pytest.raises(corral.InvalidArgument) as e:
        await desk.display.click(5000, 10)
    assert e.value.field == "x"
    with pytest.raises(corral.InvalidArgument) as e:
        await desk.display.type("naïve")
    assert e.value.field == "text"
    with pytest.raises(corral.InvalidArgument) as e:
        await desk.display.key("ctrl+nothing")
    assert e.value.field == "keys"


async def test_other_kinds_have_no_display(embedded: corral.AsyncClient) -> None:
    box = await embedded.sandboxes.create(image="debian-python:bookworm")
    try:
        assert box.display.size is None
        with pytest.raises(corral.InvalidArgument) as e:
            await box.display.screenshot()
        assert e.value.field == "kind"
    finally:
        await box.close()
