"""A container desktop's screen: Xvfb inside the sandbox, driven from the
node through the sandbox's own agent.

The frame is Xvfb's screen file (-fbdir: an XWD image Xvfb keeps mapped),
read by the agent with no symbolic link followed and parsed with every
size checked (pixels.parse_xwd). Input is XTEST, through one `xdotool`
command per action: the actions are checked and put into input commands
exactly as for a full VM (vm/display.py InputScreen), then each command
becomes an xdotool step, so both kinds of desktop accept and refuse the
same calls.

Unlike a VM's, this screen is drawn and read by code inside the sandbox:
what it shows is what the sandbox says it shows. That is all a screenshot
is for (it goes to the agent that drives the sandbox), and nothing the
sandbox writes there is trusted by the node beyond being an image.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from corral.errors import Conflict, InvalidArgument
from corral.execd.client import ExecdClient
from corral.runtimes.vm import pixels
from corral.runtimes.vm.display import MAX_TEXT, Command, InputScreen

FB_PATH = "/run/corral/fb/Xvfb_screen0"
FB_MAX = 64 << 20  # 4096x4096 at 32 bpp, and the XWD header
ENV = [
    "DISPLAY=:0",
    "HOME=/root",
    "LANG=C.UTF-8",  # xdotool reads its text as the locale's multibyte
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
]
TYPE_DELAY_MS = 12  # xdotool's pause between typed characters
ACTION_TIMEOUT = 30.0

# QEMU's button names (the input commands') to X's button numbers.
X_BUTTONS = {
    "left": 1, "middle": 2, "right": 3, "wheel-up": 4, "wheel-down": 5, "side": 8, "extra": 9,
}  # fmt: skip
# QEMU's qcodes (what combo_keys gives) to X keysym names; letters and
# digits are their own.
_KEYSYMS = {
    "ctrl": "Control_L", "ctrl_r": "Control_R", "shift": "Shift_L", "shift_r": "Shift_R",
    "alt": "Alt_L", "alt_r": "Alt_R", "meta_l": "Super_L", "meta_r": "Super_R",
    "ret": "Return", "tab": "Tab", "esc": "Escape", "spc": "space", "backspace": "BackSpace",
    "delete": "Delete", "insert": "Insert", "home": "Home", "end": "End", "pgup": "Prior",
    "pgdn": "Next", "up": "Up", "down": "Down", "left": "Left", "right": "Right",
    "caps_lock": "Caps_Lock", "num_lock": "Num_Lock", "scroll_lock": "Scroll_Lock",
    "print": "Print", "pause": "Pause", "menu": "Menu", "kp_enter": "KP_Enter",
    "kp_add": "KP_Add", "kp_subtract": "KP_Subtract", "kp_multiply": "KP_Multiply",
    "kp_divide": "KP_Divide", "kp_decimal": "KP_Decimal",
    **{f"kp_{i}": f"KP_{i}" for i in range(10)},
    **{f"f{i}": f"F{i}" for i in range(1, 13)},
    "minus": "minus", "equal": "equal", "bracket_left": "bracketleft",
    "bracket_right": "bracketright", "backslash": "backslash", "semicolon": "semicolon",
    "apostrophe": "apostrophe", "grave_accent": "grave", "comma": "comma", "dot": "period",
    "slash": "slash",
}  # fmt: skip
_LOCATION = re.compile(r"X=(\d+)\nY=(\d+)\n")


def keysym(qcode: str) -> str:
    if len(qcode) == 1 and qcode.isascii() and qcode.isalnum():
        return qcode
    return _KEYSYMS[qcode]


def xdotool_steps(commands: tuple[Command, ...]) -> list[str]:
    """The input commands as one chained xdotool command line."""
    argv: list[str] = []
    for name, args in commands:
        if name == "move":
            argv += ["mousemove", str(args["x"]), str(args["y"])]
        elif name == "send-key":
            keys: Any = args["keys"]
            argv += ["key", "+".join(keysym(k["data"]) for k in keys)]
        elif name == "input-send-event":
            events: Any = args["events"]
            for event in events:
                data = event["data"]
                if event["type"] == "btn":
                    verb = "mousedown" if data["down"] else "mouseup"
                    argv += [verb, str(X_BUTTONS[data["button"]])]
                elif event["type"] == "key":
                    verb = "keydown" if data["down"] else "keyup"
                    argv += [verb, keysym(data["key"]["data"])]
                else:
                    raise ValueError(f"no xdotool step for a {event['type']} event")
        else:
            raise ValueError(f"no xdotool step for {name}")
    return argv


def check_text(text: str) -> None:
    """XTEST types any character (xdotool maps a spare key to it): text is
    refused only for characters no key makes (controls, but newline and tab)."""
    if len(text) > MAX_TEXT:
        raise InvalidArgument("text", f"must be at most {MAX_TEXT} characters", len(text))
    for ch in text:
        if not (ch.isprintable() or ch in "\n\t"):
            raise InvalidArgument(
                "text", "must be printable characters (newline and tab type their keys)", repr(ch)
            )


def type_runs(text: str) -> list[list[str]]:
    """xdotool runs that type `text`: newline and tab as the Return and Tab
    keys (xdotool's own type sends newline as Linefeed, which most programs
    ignore), and `type` ends a run (it takes every argument after it)."""
    runs: list[list[str]] = []
    for piece in re.split(r"([\n\t])", text):
        if piece in ("\n", "\t"):
            runs.append(["key", "Return" if piece == "\n" else "Tab"])
        elif piece:
            runs.append(["type", "--delay", str(TYPE_DELAY_MS), "--", piece])
    return runs


class XScreen(InputScreen):
    """One container desktop (its X server is :0 in the sandbox)."""

    def __init__(self, sandbox_id: str, control: Path, size: tuple[int, int]) -> None:
        super().__init__(size)
        self.sandbox_id = sandbox_id
        self.client = ExecdClient(str(control))

    async def _xdotool(self, argv: list[str], timeout: float = ACTION_TIMEOUT) -> bytes:
        code, out, err = await self.client.run(
            ["xdotool", *argv], user="root", timeout=timeout, env=ENV, cap=4096
        )
        if code != 0:
            why = err.decode(errors="replace").strip()[-300:] or f"exit {code}"
            raise Conflict(f"sandbox {self.sandbox_id}: its X server refused the input: {why}")
        return bytes(out)

    async def _run(self, *commands: Command) -> None:
        async with self.lock:  # actions reach X in the order they were asked
            await self._xdotool(xdotool_steps(commands))

    def _pointer_to(self, x: int, y: int) -> Command:
        return ("move", {"x": x, "y": y})

    async def frame(self) -> pixels.Rgb:
        data = await self.client.read("root", FB_PATH, FB_MAX, nofollow=True)
        try:
            image = pixels.parse_xwd(data)
        except ValueError as exc:
            raise Conflict(
                f"sandbox {self.sandbox_id}: its screen file is unreadable: {exc}"
            ) from exc
        self.size = (image.width, image.height)
        return image

    async def pointer(self) -> tuple[int, int]:
        """Where X has the pointer (a program may have warped it)."""
        out = await self._xdotool(["getmouselocation", "--shell"])
        m = _LOCATION.match(out.decode(errors="replace"))
        if m is None:
            return self.cursor
        self.cursor = (int(m.group(1)), int(m.group(2)))
        return self.cursor

    async def type(self, text: str) -> None:
        check_text(text)
        if not text:
            return
        async with self.lock:
            for argv in type_runs(text):
                await self._xdotool(
                    argv, timeout=ACTION_TIMEOUT + len(text) * TYPE_DELAY_MS / 1000 * 4
                )
