"""A container desktop's screen without a sandbox: its actions as xdotool
steps, its key names, its text rule and its XWD reader."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from corral.errors import InvalidArgument
from corral.runtimes.container import xscreen
from corral.runtimes.vm import display, pixels


class Recorded(xscreen.XScreen):
    """An XScreen whose xdotool runs are written down, not run."""

    def __init__(self) -> None:
        super().__init__("sbx", Path("/nonexistent.sock"), (1280, 800))
        self.runs: list[list[str]] = []

    async def _xdotool(self, argv: list[str], timeout: float = 0) -> bytes:
        self.runs.append(argv)
        return b"X=10\nY=20\nSCREEN=0\nWINDOW=1\n"


@pytest.mark.parametrize(
    ("call", "argv"),
    [
        (lambda s: s.click(5, 6), ["mousemove", "5", "6", "mousedown", "1", "mouseup", "1"]),
        (lambda s: s.click(button="right"), ["mousedown", "3", "mouseup", "3"]),
        (
            lambda s: s.click(1, 2, "middle", 2),
            [
                "mousemove",
                "1",
                "2",
                "mousedown",
                "2",
                "mouseup",
                "2",
                "mousedown",
                "2",
                "mouseup",
                "2",
            ],
        ),
        (
            lambda s: s.click(0, 0, "back"),
            ["mousemove", "0", "0", "mousedown", "8", "mouseup", "8"],
        ),
        (lambda s: s.button("left", True, 3, 4), ["mousemove", "3", "4", "mousedown", "1"]),
        (lambda s: s.button("left", False), ["mouseup", "1"]),
        (lambda s: s.move(1279, 799), ["mousemove", "1279", "799"]),
        (
            lambda s: s.scroll(dy=2),
            ["mousedown", "5", "mouseup", "5", "mousedown", "5", "mouseup", "5"],
        ),
        (
            lambda s: s.scroll(dx=-1, x=9, y=9),
            [
                "mousemove",
                "9",
                "9",
                "keydown",
                "Shift_L",
                "mousedown",
                "4",
                "mouseup",
                "4",
                "keyup",
                "Shift_L",
            ],
        ),
        (lambda s: s.key("ctrl+shift+t"), ["key", "Control_L+Shift_L+t"]),
        (lambda s: s.key("Return"), ["key", "Return"]),
        (lambda s: s.key("ArrowLeft"), ["key", "Left"]),
        (lambda s: s.hold("alt+tab", True), ["keydown", "Alt_L", "keydown", "Tab"]),
        (lambda s: s.hold("alt+tab", False), ["keyup", "Tab", "keyup", "Alt_L"]),
        (lambda s: s.type("héllo, 世界"), ["type", "--delay", "12", "--", "héllo, 世界"]),
    ],
)
async def test_actions_become_one_xdotool_run(call: object, argv: list[str]) -> None:
    s = Recorded()
    await call(s)  # type: ignore[operator]
    assert s.runs == [argv]


async def test_newline_and_tab_are_typed_as_their_keys() -> None:
    s = Recorded()
    await s.type("3\n\t=A1\n")
    assert s.runs == [
        ["type", "--delay", "12", "--", "3"], ["key", "Return"], ["key", "Tab"],
        ["type", "--delay", "12", "--", "=A1"], ["key", "Return"],
    ]  # fmt: skip


async def test_a_drag_moves_in_steps_with_the_button_held() -> None:
    s = Recorded()
    await s.drag([(0, 0), (64, 0)])
    (run,) = s.runs
    assert run[:5] == ["mousemove", "0", "0", "mousedown", "1"]
    assert run[-5:] == ["mousemove", "64", "0", "mouseup", "1"]
    assert run.count("mousemove") == 1 + 64 // display.DRAG_STRIDE


async def test_the_pointer_is_where_x_says() -> None:
    assert await Recorded().pointer() == (10, 20)


def test_every_key_name_has_a_keysym() -> None:
    for qcode in set(display._NAMED.values()):
        assert xscreen.keysym(qcode)
    for ch in "abcxyz0189-=[]\\;',./`":
        for qcode in display.char_keys(ch):
            assert xscreen.keysym(qcode)


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda s: s.click(1280, 0), "x"),
        (lambda s: s.click(0, -1), "y"),
        (lambda s: s.click(5, None), "y"),
        (lambda s: s.click(1, 1, "thumb"), "button"),
        (lambda s: s.click(1, 1, "left", 4), "count"),
        (lambda s: s.key("hyper+q"), "keys"),
        (lambda s: s.key("ctrl+"), "keys"),
        (lambda s: s.type("a\x1b[2J"), "text"),
        (lambda s: s.type("\x00"), "text"),
        (lambda s: s.type("x" * (display.MAX_TEXT + 1)), "text"),
        (lambda s: s.scroll(0, 0), "dy"),
        (lambda s: s.drag([(1, 1)]), "path"),
        (lambda s: s.screenshot(0), "percent"),
        (lambda s: s.screenshot(100, pixels.Region(1200, 0, 100, 10)), "width"),
    ],
)
async def test_bad_input_is_refused_before_x_is_asked(call: object, field: str) -> None:
    s = Recorded()
    with pytest.raises(InvalidArgument) as e:
        await call(s)  # type: ignore[operator]
    assert e.value.field == field
    assert s.runs == []


def _xwd(
    w: int, h: int, rows: list[bytes], *, stride: int | None = None, ncolors: int = 0,
    depth: int = 24, order: int = 0, name: bytes = b"Xvfb main window\0",
) -> bytes:  # fmt: skip
    stride = stride or 4 * w
    header_size = 100 + len(name)
    fields = [header_size, 7, 2, depth, w, h, 0, order, 32, order, 32, 32, stride, 4,
              0xFF0000, 0xFF00, 0xFF, 8, 256, ncolors, w, h, 0, 0, 0]  # fmt: skip
    body = b"".join(r.ljust(stride, b"\0") for r in rows)
    colormap = b"\0" * (12 * ncolors) if ncolors < 1000 else b""  # a lie about its size
    return struct.pack(">25I", *fields) + name + colormap + body


def test_an_xwd_screen_file_reads_as_rgb() -> None:
    # Two pixels a row, B G R X (LSBFirst), a padded line and a colormap.
    rows = [bytes([1, 2, 3, 0, 4, 5, 6, 0]), bytes([7, 8, 9, 0, 10, 11, 12, 0])]
    image = pixels.parse_xwd(_xwd(2, 2, rows, stride=12, ncolors=3))
    assert (image.width, image.height) == (2, 2)
    assert image.data == bytes([3, 2, 1, 6, 5, 4, 9, 8, 7, 12, 11, 10])


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\0" * 99,
        _xwd(2, 1, [b"\0" * 8])[:-1],  # truncated pixels
        _xwd(2, 1, [b"\0" * 8], depth=16),
        _xwd(0, 1, []),
        _xwd(9000, 1, [b""]),
        _xwd(2, 1, [b"\0" * 8], stride=4),  # a line shorter than its pixels
        _xwd(2, 1, [b"\0" * 8], ncolors=1 << 28),  # a colormap past the end
    ],
)
def test_a_bad_screen_file_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        pixels.parse_xwd(data)
