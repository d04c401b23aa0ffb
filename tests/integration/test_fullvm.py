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
import re
import time
from collections.abc import AsyncIterator, Callable

import pytest

import corral
from corral.runtimes.vm import desktop

from ..framework import png_pixels, require_image

GREEN = (0, 255, 0)


@pytest.fixture(params=[pytest.param("fullvm", marks=pytest.mark.requires_qemu), "container"])
async def desk(
    embedded: corral.AsyncClient, request: pytest.FixtureRequest
) -> AsyncIterator[corral.AsyncSandbox]:
    """The small desktop on a full VM (QEMU's screen) and in a container
    (Xvfb's): every test of the display runs on both."""
    require_image(desktop.BASE)
    s = await embedded.sandboxes.create(
        kind=request.param, image=desktop.BASE, toolkit=[desktop.TOOLKIT], memory="1GiB",
        display_size="1024x768",
    )  # fmt: skip
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


async def test_open_a_terminal_by_clicking_type_and_read_the_screen(
    desk: corral.AsyncSandbox,
) -> None:
    assert desk.display.size == (1024, 768)
    bg = desktop.DESKTOP_RGB
    # Ready means drawn: the first screenshot after create shows the
    # desktop's background and the launcher in the top-left corner.
    _, _, rows = png_pixels(await desk.display.screenshot())
    assert _pixel(rows, 900, 700) == bg
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
    # A long text, shifted and unshifted keys mixed, arrives whole and in
    # order: QEMU's own send-key queue holds 1024 events and dropped the
    # rest (whole lines lost, shift left held), display._paced.
    text = "The Quick Brown Fox: jumps over 13 lazy dogs! #@$%^&*()_+{}|~<>? ok\n" * 16
    await desk.display.type("cat > /tmp/long\n")
    await desk.display.type(text)
    await desk.display.key("ctrl+d")
    await _until_file(desk, "/tmp/long", text.encode())
    # Bad input is refused by name, before the screen hears of it.
    with pytest.raises(corral.InvalidArgument) as e:
        await desk.display.click(5000, 10)
    assert e.value.field == "x"
    if desk.info.kind == "fullvm":
        # QEMU's keyboard is a US one: what it has no key for is refused.
        with pytest.raises(corral.InvalidArgument) as e:
            await desk.display.type("naïve")
        assert e.value.field == "text"
    else:
        # XTEST types any character (xdotool maps a spare key to it).
        await desk.display.type("echo naïve €5 > /tmp/u\n")
        await _until_file(desk, "/tmp/u", "naïve €5\n".encode())
        with pytest.raises(corral.InvalidArgument) as e:
            await desk.display.type("\x1b[2J")
        assert e.value.field == "text"
    with pytest.raises(corral.InvalidArgument) as e:
        await desk.display.key("ctrl+nothing")
    assert e.value.field == "keys"


async def _until_file(sbx: corral.AsyncSandbox, path: str, want: bytes) -> None:
    deadline = time.monotonic() + 60
    while (r := await sbx.commands.run(f"cat {path}")).stdout.encode() != want:
        assert time.monotonic() < deadline, f"{path} holds {r.stdout!r}, not {want!r}"
        await asyncio.sleep(0.5)


async def test_a_sandbox_without_a_display_says_so(embedded: corral.AsyncClient) -> None:
    box = await embedded.sandboxes.create(image="debian-python:bookworm")
    try:
        assert box.display.size is None
        with pytest.raises(corral.InvalidArgument) as e:
            await box.display.screenshot()
        assert e.value.field == "display_size"
    finally:
        await box.close()


async def test_a_container_desktop_needs_an_image_with_a_session(
    embedded: corral.AsyncClient,
) -> None:
    """Asked for on an image with no desktop: a clear error, nothing left."""
    before = {s.id for s in await embedded.sandboxes.list()}
    with pytest.raises(corral.InvalidArgument) as e:
        await embedded.sandboxes.create(image="debian-python:bookworm", display_size="800x600")
    assert e.value.field == "display_size" and "/etc/corral/session" in str(e.value)
    assert {s.id for s in await embedded.sandboxes.list()} == before


def _xev_events(log: str) -> list[str]:
    """xev's button and key events, in order: 'press 3', 'release shift'..."""
    out = []
    pattern = (
        r"(ButtonPress|ButtonRelease|KeyPress|KeyRelease) event.*?\n.*?\n.*?"
        r"(?:button (\d+)|keycode \d+ \(keysym 0x[0-9a-f]+, (\w+)\))"
    )
    for kind, button, key in re.findall(pattern, log):
        verb = "press" if kind.endswith("Press") else "release"
        out.append(f"{verb} {button or key}")
    return out


async def test_every_pointer_and_key_action_reaches_a_program_in_order(
    desk: corral.AsyncSandbox,
) -> None:
    """xev, a standard X program, prints each event it gets: the whole
    action set is checked against what a program in the guest saw."""
    d = desk.display
    apps = {a.id: a for a in await d.apps()}
    assert apps["debian-xterm"].command == "xterm"
    await desk.commands.start(
        "DISPLAY=:0 xev -geometry 400x300+300+200 -event button -event keyboard >/tmp/xev.log"
    )
    deadline = time.monotonic() + 60
    while not [w for w in await d.windows() if w.title == "Event Tester"]:
        assert time.monotonic() < deadline, "xev's window never appeared"
        await asyncio.sleep(0.5)
    (tester,) = [w for w in await d.windows() if w.title == "Event Tester"]
    assert (tester.width, tester.height) == (400, 300)
    assert 300 <= tester.x <= 310 and 200 <= tester.y <= 230  # twm's border and title
    cx, cy = tester.x + 200, tester.y + 150
    await d.right_click(cx, cy)
    await d.middle_click()  # where the pointer is
    await d.double_click(cx, cy)
    await d.scroll(2)
    await d.scroll(-1, x=cx, y=cy)
    await d.scroll(dx=1)
    await d.mouse_down(cx - 50, cy)
    await d.move(cx - 40, cy + 10)
    await d.mouse_up()
    assert await d.cursor() == (cx - 40, cy + 10)
    await d.drag([(cx, cy), (cx + 30, cy + 30)])
    await d.key_down("shift")
    await d.type("a")
    await d.key_up("shift")
    await d.key("ctrl+b")
    await d.wait(2)
    events = _xev_events((await desk.files.read("/tmp/xev.log")).decode())
    pointer = [
        "press 3", "release 3", "press 2", "release 2",
        "press 1", "release 1", "press 1", "release 1",  # double
        "press 5", "release 5", "press 5", "release 5", "press 4", "release 4",
        "press Shift_L", "press 5", "release 5", "release Shift_L",  # dx: shift + wheel
        "press 1", "release 1",  # mouse_down, move, mouse_up
        "press 1", "release 1",  # drag
    ]  # fmt: skip
    assert events[: len(pointer)] == pointer, events
    keys = events[len(pointer) :]
    # Shift held while 'a' is pressed types 'A'; when each key goes up
    # (send-key's hold time against key_up) is the guest's to order.
    assert [e for e in keys if e.startswith("press")] == [
        "press Shift_L", "press A", "press Control_L", "press b"
    ], events  # fmt: skip
    assert len(keys) == 8 and keys.index("release Shift_L") < keys.index("press Control_L")


async def test_launch_apps_list_windows_and_cut_screenshots(desk: corral.AsyncSandbox) -> None:
    d = desk.display
    started = await d.launch("XTerm")  # by name, any case
    assert started.id == "debian-xterm"
    deadline = time.monotonic() + 60
    while not [w for w in await d.windows() if w.title == "xterm"]:
        assert time.monotonic() < deadline, "xterm's window never appeared"
        await asyncio.sleep(0.5)
    (term,) = [w for w in await d.windows() if w.title == "xterm"]
    assert term.width > 100 and term.height > 100
    with pytest.raises(corral.InvalidArgument) as e:
        await d.launch("gimp")
    assert e.value.field == "app" and "debian-xterm" in str(e.value)
    # A region and a scaled copy, cut from the same screen on the host.
    w, h, _ = png_pixels(await d.screenshot(region=(10, 20, 300, 200)))
    assert (w, h) == (300, 200)
    w, h, small = png_pixels(await d.screenshot(scale=0.5))
    assert (w, h) == (512, 384)
    assert _pixel(small, 450, 350) == desktop.DESKTOP_RGB
    for kwargs, field in [
        ({"region": (1000, 0, 100, 100)}, "width"),
        ({"region": (0, 800, 10, 10)}, "y"),
        ({"region": (0, 0, 0, 10)}, "region"),
        ({"scale": 0.01}, "scale"),
        ({"scale": 2.0}, "scale"),
    ]:
        with pytest.raises(corral.InvalidArgument) as e:
            await d.screenshot(**kwargs)  # type: ignore[arg-type]
        assert e.value.field == field, kwargs
