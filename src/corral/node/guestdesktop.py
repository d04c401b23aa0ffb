"""What only the desktop inside a sandbox knows: its windows and its
installed applications, and starting one.

The host reads the screen and sends input itself (runtimes/vm/display.py);
window titles and desktop entries live in the guest's X server and file
system, so they are asked for with a command in the sandbox, run by the
standard X tools (xwininfo, xprop from x11-utils) and the freedesktop
desktop entries in /usr/share/applications. Their output comes from the
guest and is parsed as hostile: bounded in size and count, lines that do
not parse are skipped, nothing in it is run on the host.
"""

from __future__ import annotations

import re

from corral.api.models import App, Window
from corral.errors import InvalidArgument

DISPLAY_ENV = {"DISPLAY": ":0", "HOME": "/root", "LANG": "C.UTF-8"}
MAX_WINDOWS = 256
MAX_APPS = 512
MAX_TITLE = 256
OUTPUT_LIMIT = 1 << 20

_NEED_X11_UTILS = (
    "for t in xwininfo xprop; do command -v $t >/dev/null || "
    '{ echo "the desktop image has no $t (Debian package x11-utils)" >&2; exit 127; }; done\n'
)

# The window tree, then each named window's WM_STATE: a window manager
# sets WM_STATE on the client windows it manages (ICCCM 4.1.3.1), so
# "Normal" is exactly the windows a user sees and can pick.
WINDOWS_SCRIPT = (
    _NEED_X11_UTILS
    + """tree=$(xwininfo -root -tree) || exit 1
printf '%s\\n' "$tree"
echo '-- states'
printf '%s\\n' "$tree" | sed -n 's/^ *\\(0x[0-9a-f]*\\) ".*/\\1/p' | head -n 512 |
while read -r id; do
  printf '%s %s\\n' "$id" "$(xprop -id "$id" WM_STATE 2>/dev/null | sed -n 's/.*window state: //p')"
done
"""
)

# Each desktop entry's file name, then its [Desktop Entry] keys that matter.
APPS_SCRIPT = """for f in /usr/share/applications/*.desktop; do
  [ -f "$f" ] || continue
  printf '== %s\\n' "${f##*/}"
  sed -n '/^\\[Desktop Entry\\]/,/^\\[[^D]/{/^\\(Name\\|Exec\\|Type\\|Hidden\\)=/p}' "$f"
done | head -c 1000000
"""

# The app's own command line, detached from the exec call (it outlives it).
LAUNCH_SCRIPT = 'cd "$HOME" && setsid sh -c "$1" </dev/null >/dev/null 2>&1 &'

# `0x1a00003 "title": ("res" "Class")  484x316+0+0  +120+60`
_TREE_LINE = re.compile(
    r'^\s*(0x[0-9a-f]+) "(.*)":.*?\s(\d+)x(\d+)[+-]-?\d+[+-]-?\d+\s+\+?(-?\d+)\+?(-?\d+)\s*$'
)
_FIELD_CODE = re.compile(r"%[%fFuUdDnNickvm]")  # the Exec key's field codes; %% is '%'


def parse_windows(text: str, screen: tuple[int, int] | None = None) -> list[Window]:
    """The managed windows in `text`; with `screen`, only those on it (a
    toolkit parks helper windows at -9999)."""
    tree, _, states_text = text.partition("\n-- states\n")
    states: dict[str, str] = {}
    for line in states_text.splitlines():
        wid, _, state = line.partition(" ")
        states[wid] = state.strip()
    windows: list[Window] = []
    for line in tree.splitlines():
        m = _TREE_LINE.match(line)
        if m is None or states.get(m.group(1)) != "Normal":
            continue
        wid, title, w, h, x, y = m.groups()
        if screen is not None and not _on_screen(int(x), int(y), int(w), int(h), screen):
            continue
        windows.append(
            Window(id=wid, title=title[:MAX_TITLE], x=int(x), y=int(y), width=int(w), height=int(h))
        )
        if len(windows) >= MAX_WINDOWS:
            break
    return windows


def _on_screen(x: int, y: int, w: int, h: int, screen: tuple[int, int]) -> bool:
    return x < screen[0] and y < screen[1] and x + w > 0 and y + h > 0


def parse_apps(text: str) -> list[App]:
    apps: list[App] = []
    entry: dict[str, str] = {}

    def flush() -> None:
        name, command = entry.get("Name", ""), entry.get("Exec", "")
        usable = entry.get("Type", "Application") == "Application" and entry.get("Hidden") != "true"
        if entry.get("id") and name and command and usable and len(apps) < MAX_APPS:
            command = _FIELD_CODE.sub(lambda m: "%" if m.group(0) == "%%" else "", command)
            apps.append(App(id=entry["id"], name=name[:MAX_TITLE], command=command.strip()))

    for line in text.splitlines():
        if line.startswith("== "):
            flush()
            entry = {"id": line[3:].removesuffix(".desktop")}
            continue
        key, sep, value = line.partition("=")
        if sep and key not in entry:  # the first Name= is the untranslated one
            entry[key] = value
    flush()
    return sorted(apps, key=lambda a: a.id)


def pick_app(apps: list[App], wanted: str) -> App:
    """The installed app `wanted` names: its id, its Name or its
    command's program, in any case."""
    key = wanted.lower()

    def program(a: App) -> str:
        return a.command.split()[0].rsplit("/", 1)[-1] if a.command.split() else ""

    for field in (lambda a: a.id, lambda a: a.name, program):
        found = [a for a in apps if field(a).lower() == key]
        if found:
            return found[0]
    names = ", ".join(a.id for a in apps) or "none"
    raise InvalidArgument("app", f"must be an installed application ({names})", wanted)
