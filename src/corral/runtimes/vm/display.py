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
import struct
from pathlib import Path

from corral.errors import InvalidArgument
from corral.runtimes.vm.qmp import Qmp

MAX_TEXT = 4096
TABLET_MAX = 0x7FFF  # QEMU scales absolute axes to 0..32767
BUTTONS = ("left", "middle", "right")

# Named keys a caller may use in key("ctrl+alt+t"), to QEMU's qcodes.
_NAMED = {
    "ctrl": "ctrl", "control": "ctrl", "shift": "shift", "alt": "alt",
    "super": "meta_l", "meta": "meta_l", "win": "meta_l",
    "enter": "ret", "return": "ret", "tab": "tab", "esc": "esc", "escape": "esc",
    "space": "spc", "backspace": "backspace", "delete": "delete", "del": "delete",
    "insert": "insert", "home": "home", "end": "end", "pageup": "pgup", "pagedown": "pgdn",
    "up": "up", "down": "down", "left": "left", "right": "right",
    **{f"f{i}": f"f{i}" for i in range(1, 13)},
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


def png_size(png: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    if len(png) < 24 or png[:8] != b"\x89PNG\r\n\x1a\n" or png[12:16] != b"IHDR":
        raise ValueError("not a PNG")
    w, h = struct.unpack(">II", png[16:24])
    return int(w), int(h)


class Display:
    """One guest's display. QEMU serves one QMP client at a time, so calls
    on a display are serialised; suspend takes the same lock."""

    def __init__(self, qmp_socket: Path, shot_path: Path, size: tuple[int, int]) -> None:
        self.qmp_socket = qmp_socket
        self.shot_path = shot_path
        self.size = size
        self.lock = asyncio.Lock()

    async def _run(self, *commands: tuple[str, dict[str, object]]) -> None:
        async with self.lock:
            qmp = await Qmp.connect(self.qmp_socket, timeout=10)
            try:
                for name, args in commands:
                    await qmp.execute(name, **args)
            finally:
                qmp.close()

    async def screenshot(self) -> bytes:
        tmp = self.shot_path.with_suffix(".tmp")
        await self._run(("screendump", {"filename": str(tmp), "format": "png"}))
        data = await asyncio.to_thread(tmp.read_bytes)
        tmp.unlink(missing_ok=True)
        self.size = png_size(data)
        return data

    def _check_point(self, x: int, y: int) -> None:
        w, h = self.size
        if not 0 <= x < w:
            raise InvalidArgument("x", f"must be within the screen's width 0..{w - 1}", x)
        if not 0 <= y < h:
            raise InvalidArgument("y", f"must be within the screen's height 0..{h - 1}", y)

    async def click(self, x: int, y: int, button: str = "left", count: int = 1) -> None:
        self._check_point(x, y)
        if button not in BUTTONS:
            raise InvalidArgument("button", f"must be one of {', '.join(BUTTONS)}", button)
        if not 1 <= count <= 3:
            raise InvalidArgument("count", "must be 1 (click), 2 (double) or 3", count)
        steps = [self._pointer_to(x, y)]
        for _ in range(count):
            for down in (True, False):
                event = {"type": "btn", "data": {"down": down, "button": button}}
                steps.append(("input-send-event", {"events": [event]}))
        await self._run(*steps)

    async def move(self, x: int, y: int) -> None:
        self._check_point(x, y)
        await self._run(self._pointer_to(x, y))

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
        await self._run(("send-key", _send_key(combo_keys(combo))))


def _send_key(qcodes: list[str]) -> dict[str, object]:
    return {"keys": [{"type": "qcode", "data": q} for q in qcodes], "hold-time": 20}
