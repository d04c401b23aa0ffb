"""A full VM's screen, pointer and keyboard, driven through QMP.

The guest sees a std VGA (its bochs DRM driver), a virtio tablet (absolute
coordinates, so a click lands where it is aimed whatever the guest's pointer
acceleration) and a virtio keyboard. Nothing here runs in the guest: a
screenshot is QEMU's own copy of the framebuffer, input is injected as
hardware events. So a guest that hangs still shows its last frame, and
nothing the guest does can forge what the host reads off its screen.

Input is checked before it is sent: a click inside the screen, text made of
characters a US keyboard types, keys QEMU knows.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from corral.errors import InvalidArgument
from corral.runtimes.vm import pixels
from corral.runtimes.vm.qmp import Qmp

MAX_TEXT = 4096
MAX_PATH = 64  # points in a drag
MAX_SCROLL = 50  # wheel notches in one scroll
DRAG_STRIDE = 16  # a drag moves at most this far (pixels) between motion events
DRAG_STEPS = 32  # ...and in at most this many steps between two points
KEY_HOLD_MS = 20  # how long each key of a send-key is held down
KEY_GAP_MS = 10  # and the pause after its release, before the next key
PAUSE = "corral-pause"  # not QMP: a wait between two paced commands (_paced)
DEVICE_ORDER_PAUSE = 0.05  # s between events on two devices that must arrive in order
TABLET_MAX = 0x7FFF  # QEMU scales absolute axes to 0..32767
# Button names a caller uses, to QEMU's (OpenAI's computer use calls the
# middle button "wheel" and the side buttons "back" and "forward").
BUTTONS = {
    "left": "left", "middle": "middle", "right": "right", "wheel": "middle",
    "back": "side", "forward": "extra",
}  # fmt: skip

# Named keys a caller may use in key("ctrl+alt+t"), to QEMU's qcodes.
_NAMED = {
    "ctrl": "ctrl", "control": "ctrl", "shift": "shift", "alt": "alt",
    "super": "meta_l", "meta": "meta_l", "win": "meta_l",
    "enter": "ret", "return": "ret", "tab": "tab", "esc": "esc", "escape": "esc",
    "space": "spc", "backspace": "backspace", "delete": "delete", "del": "delete",
    "insert": "insert", "home": "home", "end": "end", "pageup": "pgup", "pagedown": "pgdn",
    "up": "up", "down": "down", "left": "left", "right": "right",
    **{f"f{i}": f"f{i}" for i in range(1, 13)},
    # X keysym names (xdotool's, which Anthropic's computer-use `key` takes)
    # and browser key names (OpenAI's `keypress`), lowercased.
    "shift_l": "shift", "shift_r": "shift_r", "control_l": "ctrl", "control_r": "ctrl_r",
    "ctrl_l": "ctrl", "ctrl_r": "ctrl_r", "alt_l": "alt", "alt_r": "alt_r",
    "super_l": "meta_l", "super_r": "meta_r", "cmd": "meta_l", "command": "meta_l",
    "option": "alt", "altgr": "alt_r", "meta_l": "meta_l", "meta_r": "meta_r",
    "page_up": "pgup", "page_down": "pgdn", "prior": "pgup", "next": "pgdn",
    "arrowup": "up", "arrowdown": "down", "arrowleft": "left", "arrowright": "right",
    "caps_lock": "caps_lock", "capslock": "caps_lock", "num_lock": "num_lock",
    "scroll_lock": "scroll_lock", "print": "print", "printscreen": "print",
    "pause": "pause", "menu": "menu", "contextmenu": "menu",
    "kp_enter": "kp_enter", "kp_add": "kp_add", "kp_subtract": "kp_subtract",
    "kp_multiply": "kp_multiply", "kp_divide": "kp_divide", "kp_decimal": "kp_decimal",
    **{f"kp_{i}": f"kp_{i}" for i in range(10)},
    "minus": "minus", "equal": "equal", "comma": "comma", "period": "dot",
    "slash": "slash", "semicolon": "semicolon", "apostrophe": "apostrophe",
    "bracketleft": "bracket_left", "bracketright": "bracket_right",
    "backslash": "backslash", "grave": "grave_accent",
}  # fmt: skip
# Unshifted punctuation and the shifted character on the same key.
_PUNCT = {
    "-": "minus", "=": "equal", "[": "bracket_left", "]": "bracket_right",
    "\\": "backslash", ";": "semicolon", "'": "apostrophe", "`": "grave_accent",
    ",": "comma", ".": "dot", "/": "slash", " ": "spc", "\n": "ret", "\t": "tab",
}  # fmt: skip
_SHIFTED = {
    "_": "minus", "+": "equal", "{": "bracket_left", "}": "bracket_right",
    "|": "backslash", ":": "semicolon", '"': "apostrophe", "~": "grave_accent",
    "<": "comma", ">": "dot", "?": "slash",
    "!": "1", "@": "2", "#": "3", "$": "4", "%": "5", "^": "6", "&": "7", "*": "8",
    "(": "9", ")": "0",
}  # fmt: skip


def char_keys(ch: str) -> list[str]:
    """The qcodes pressed together to type `ch` on a US layout."""
    if ch.isascii() and (ch.islower() or ch.isdigit()):
        return [ch]
    if ch.isascii() and ch.isupper():
        return ["shift", ch.lower()]
    if ch in _PUNCT:
        return [_PUNCT[ch]]
    if ch in _SHIFTED:
        return ["shift", _SHIFTED[ch]]
    raise InvalidArgument("text", "must be characters a US keyboard types (ASCII)", repr(ch))


def combo_keys(combo: str) -> list[str]:
    """'ctrl+shift+t' -> qcodes. A single character names its key; a letter
    names the key whatever its case ('ctrl+C' is 'ctrl+c': shift is asked
    for by name), other characters keep theirs ('+' is shift and '=')."""
    parts = combo.split("+") if combo != "+" else ["+"]
    if not combo or any(not part for part in parts):
        raise InvalidArgument("keys", "must be key names joined by '+', like 'ctrl+c'", combo)
    out: list[str] = []
    for part in parts:
        name = part.lower()
        if name in _NAMED:
            out.append(_NAMED[name])
        elif len(part) == 1:
            out += char_keys(part.lower() if part.isascii() and part.isalpha() else part)
        else:
            raise InvalidArgument(
                "keys", f"must name keys ({', '.join(sorted(_NAMED))} or one character)", part
            )
    return list(dict.fromkeys(out))  # "shift+A" presses shift once


Command = tuple[str, dict[str, object]]


class InputScreen:
    """A screen's actions, checked, then put into input commands. The
    commands are QMP's (a full VM's own language): `input-send-event`
    (the pointer's position, buttons and keys down or up) and `send-key`
    (keys pressed together and released). Each kind of screen sends them
    its own way (_run) and reads its frames its own way (frame).

    `cursor` is where Corral last put the pointer."""

    def __init__(self, size: tuple[int, int]) -> None:
        self.size = size
        self.cursor = (size[0] // 2, size[1] // 2)
        self.lock = asyncio.Lock()

    async def _run(self, *commands: Command) -> None:
        raise NotImplementedError

    async def frame(self) -> pixels.Rgb:
        """The screen's pixels now."""
        raise NotImplementedError

    async def _whole_png(self) -> bytes:
        image = await self.frame()
        return await asyncio.to_thread(pixels.png, image)

    async def screenshot(self, percent: int = 100, region: pixels.Region | None = None) -> bytes:
        """A PNG of the screen, or of `region`, at `percent` of its size
        (both checked before the screen is read)."""
        pixels.check_percent(percent)
        if region is not None:
            region.check(self.size)
        if region is None and percent >= 100:
            return await self._whole_png()
        image = await self.frame()
        if region is not None:
            region.check(self.size)  # the guest may have changed its mode since
            image = pixels.cut(image, region)
        return await asyncio.to_thread(lambda: pixels.png(pixels.scaled(image, percent)))

    async def pointer(self) -> tuple[int, int]:
        """Where the pointer is."""
        return self.cursor

    def check_point(self, x: int, y: int) -> None:
        w, h = self.size
        if not 0 <= x < w:
            raise InvalidArgument("x", f"must be within the screen's width 0..{w - 1}", x)
        if not 0 <= y < h:
            raise InvalidArgument("y", f"must be within the screen's height 0..{h - 1}", y)

    def _at(self, x: int | None, y: int | None) -> tuple[int, int] | None:
        """(x, y) checked, or None (where the pointer is) when both are."""
        if x is None and y is None:
            return None
        if x is None or y is None:
            raise InvalidArgument("x" if x is None else "y", "must be given with the other", None)
        self.check_point(x, y)
        return x, y

    def _go(self, at: tuple[int, int] | None) -> list[tuple[str, dict[str, object]]]:
        """The pointer's move to `at` (none: a button acts where it is)."""
        if at is None:
            return []
        self.cursor = at
        return [self._pointer_to(*at)]

    async def click(
        self, x: int | None = None, y: int | None = None, button: str = "left", count: int = 1
    ) -> None:
        """Click `count` times (2: double, 3: triple) at (x, y), or where
        the pointer is."""
        at = self._at(x, y)
        qbutton = _button(button)
        if not 1 <= count <= 3:
            raise InvalidArgument("count", "must be 1 (click), 2 (double) or 3 (triple)", count)
        steps = self._go(at)
        for _ in range(count):
            steps += [_btn(qbutton, True), _btn(qbutton, False)]
        await self._run(*steps)

    async def button(
        self, button: str, down: bool, x: int | None = None, y: int | None = None
    ) -> None:
        """Press (down) or release a button, at (x, y) or where the pointer is."""
        at = self._at(x, y)
        await self._run(*self._go(at), _btn(_button(button), down))

    async def move(self, x: int, y: int) -> None:
        self.check_point(x, y)
        await self._run(self._pointer_to(x, y))
        self.cursor = (x, y)

    async def drag(self, path: list[tuple[int, int]], button: str = "left") -> None:
        """Press at the path's first point, move through the others (in
        steps a program sees as motion), release at the last."""
        if not 2 <= len(path) <= MAX_PATH:
            raise InvalidArgument("path", f"must be 2..{MAX_PATH} points", len(path))
        for px, py in path:
            self.check_point(px, py)
        qbutton = _button(button)
        steps = [self._pointer_to(*path[0]), _btn(qbutton, True)]
        for (ax, ay), (bx, by) in itertools.pairwise(path):
            n = max(1, min(DRAG_STEPS, max(abs(bx - ax), abs(by - ay)) // DRAG_STRIDE))
            steps += [
                self._pointer_to(ax + (bx - ax) * i // n, ay + (by - ay) * i // n)
                for i in range(1, n + 1)
            ]
        steps.append(_btn(qbutton, False))
        await self._run(*steps)
        self.cursor = path[-1]

    async def scroll(
        self, dx: int = 0, dy: int = 0, x: int | None = None, y: int | None = None
    ) -> None:
        """Turn the wheel `dy` notches down (negative: up) and `dx` right
        (negative: left; sent as shift + wheel), at (x, y) or where the
        pointer is."""
        at = self._at(x, y)
        for name, value in (("dx", dx), ("dy", dy)):
            if not -MAX_SCROLL <= value <= MAX_SCROLL:
                raise InvalidArgument(name, f"must be -{MAX_SCROLL}..{MAX_SCROLL} notches", value)
        if dx == 0 and dy == 0:
            raise InvalidArgument("dy", "or dx must be non-zero (notches to scroll)", 0)
        steps = [*self._go(at), *_wheel(dy)]
        if dx:
            # QEMU 7.2's virtio tablet has no horizontal wheel (its
            # wheel-left/right never reach the guest): shift + wheel is
            # the horizontal scroll of GTK, Qt, Chromium, Firefox and
            # LibreOffice.
            shift = {"type": "key", "data": {"key": {"type": "qcode", "data": "shift"}}}
            steps.append(("input-send-event", {"events": [_down(shift, True)]}))
            steps += _wheel(dx)
            steps.append(("input-send-event", {"events": [_down(shift, False)]}))
        await self._run(*steps)

    def _pointer_to(self, x: int, y: int) -> tuple[str, dict[str, object]]:
        w, h = self.size
        return (
            "input-send-event",
            {
                "events": [
                    {
                        "type": "abs",
                        "data": {"axis": "x", "value": x * TABLET_MAX // max(1, w - 1)},
                    },
                    {
                        "type": "abs",
                        "data": {"axis": "y", "value": y * TABLET_MAX // max(1, h - 1)},
                    },
                ]
            },
        )

    async def type(self, text: str) -> None:
        if len(text) > MAX_TEXT:
            raise InvalidArgument("text", f"must be at most {MAX_TEXT} characters", len(text))
        keys = [char_keys(ch) for ch in text]  # all checked before any is sent
        await self._run(*[("send-key", _send_key(k)) for k in keys])

    async def key(self, combo: str) -> None:
        """Press the keys of `combo` together and release them."""
        await self._run(("send-key", _send_key(combo_keys(combo))))

    async def hold(self, combo: str, down: bool) -> None:
        """Press (down) the keys of `combo` and keep them pressed, or
        release them (in the reverse order)."""
        keys = combo_keys(combo)
        events = [
            {"type": "key", "data": {"down": down, "key": {"type": "qcode", "data": q}}}
            for q in (keys if down else reversed(keys))
        ]
        await self._run(("input-send-event", {"events": events}))


class Display(InputScreen):
    """A full VM's display, through QMP. QEMU serves one QMP client at a
    time, so calls on a display are serialised; suspend takes the same lock.

    The tablet is absolute: the guest cannot move it, so the pointer is
    where Corral last put it unless a program in the guest warped its own
    cursor (X starts it mid-screen)."""

    def __init__(self, qmp_socket: Path, shot_path: Path, size: tuple[int, int]) -> None:
        super().__init__(size)
        self.qmp_socket = qmp_socket
        self.shot_path = shot_path
        self._last_device: str | None = None
        self._last_at = 0.0

    async def _run(self, *commands: Command) -> None:
        async with self.lock:
            qmp = await Qmp.connect(self.qmp_socket, timeout=10)
            try:
                for name, args in _paced(commands):
                    if name == PAUSE:
                        await asyncio.sleep(cast(float, args["s"]))
                        continue
                    device = _device(name, args)
                    if device is not None:
                        # Keyboard and tablet are two devices the guest reads
                        # apart: an event on one right after the other's may
                        # overtake it (shift held around a wheel turn would not
                        # be). A switch waits until the last event is old.
                        since = time.monotonic() - self._last_at
                        if device != self._last_device and since < DEVICE_ORDER_PAUSE:
                            await asyncio.sleep(DEVICE_ORDER_PAUSE - since)
                        self._last_device = device
                    await qmp.execute(name, **args)
                    if device is not None:
                        self._last_at = time.monotonic()
            finally:
                qmp.close()

    async def _dump(self, fmt: str) -> bytes:
        tmp = self.shot_path.with_suffix(f".{fmt}.tmp")
        await self._run(("screendump", {"filename": str(tmp), "format": fmt}))
        data = await asyncio.to_thread(tmp.read_bytes)
        tmp.unlink(missing_ok=True)
        return data

    async def frame(self) -> pixels.Rgb:
        """The screen's pixels now."""
        image = pixels.parse_ppm(await self._dump("ppm"))
        self.size = (image.width, image.height)
        return image

    async def _whole_png(self) -> bytes:
        data = await self._dump("png")  # QEMU encodes it: no copy through Python
        self.size = pixels.png_size(data)
        return data


def _button(name: str) -> str:
    if name not in BUTTONS:
        raise InvalidArgument("button", f"must be one of {', '.join(BUTTONS)}", name)
    return BUTTONS[name]


def _wheel(notches: int) -> list[tuple[str, dict[str, object]]]:
    """Wheel clicks: down (positive) or up."""
    wheel = "wheel-down" if notches > 0 else "wheel-up"
    return [step for _ in range(abs(notches)) for step in (_btn(wheel, True), _btn(wheel, False))]


def _device(name: str, args: dict[str, Any]) -> str | None:
    """Which input device a QMP command drives, if any."""
    if name == "send-key":
        return "keyboard"
    if name == "input-send-event":
        return "keyboard" if args["events"][0]["type"] == "key" else "tablet"
    return None


def _down(event: dict[str, Any], down: bool) -> dict[str, Any]:
    return {"type": event["type"], "data": {**event["data"], "down": down}}


def _btn(qbutton: str, down: bool) -> tuple[str, dict[str, object]]:
    event = {"type": "btn", "data": {"down": down, "button": qbutton}}
    return ("input-send-event", {"events": [event]})


def _paced(commands: tuple[Command, ...]) -> Iterator[Command]:
    """The commands as a full VM plays them: each send-key becomes its
    keys down, a pause of KEY_HOLD_MS, its keys up (last pressed, first
    released) and a pause of KEY_GAP_MS, all on Corral's clock.

    Not QEMU's send-key: QEMU plays it from one queue of at most 1024
    events, drained by a timer of its main loop, and drops what does not
    fit. Under load (four TCG desktops on two cores) the queue filled
    while a line was typed: lines were lost whole, and a lost shift-up
    left shift held (measured: `echo ... >> /tmp/t` arrived as
    `ECHO ... >?TMP`). input-send-event reaches the device at once, and
    the next key is not sent before this one is up."""
    for name, args in commands:
        if name != "send-key":
            yield name, args
            continue
        keys = cast(list[dict[str, object]], args["keys"])
        for down, order in ((True, keys), (False, keys[::-1])):
            events = [{"type": "key", "data": {"down": down, "key": k}} for k in order]
            yield "input-send-event", {"events": events}
            yield PAUSE, {"s": (KEY_HOLD_MS if down else KEY_GAP_MS) / 1000}


def _send_key(qcodes: list[str]) -> dict[str, object]:
    return {"keys": [{"type": "qcode", "data": q} for q in qcodes], "hold-time": KEY_HOLD_MS}
