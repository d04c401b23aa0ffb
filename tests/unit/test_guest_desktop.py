"""Parsing what a desktop inside a sandbox says about its windows and
applications: the guest's output is hostile, so what does not parse is
skipped and everything is bounded."""

from __future__ import annotations

import pytest

from corral.api.models import LaunchRequest, validated
from corral.errors import InvalidArgument
from corral.node import guestdesktop

TREE = """
xwininfo: Window id: 0x4c5 (the root window) (has no name)

  Root window id: 0x4c5 (the root window) (has no name)
  Parent window id: 0x0 (none)
     4 children:
     0x40001e (has no name): ()  96x60+0+0  +0+0
        1 child:
        0x40001b "xmessage": ("xmessage" "Xmessage")  90x54+2+2  +2+2
     0x600010 (has no name): ()  490x339+50+29  +50+29
        2 children:
        0x60000c "xterm": ("xterm" "XTerm")  484x316+2+21  +52+52
        0x600011 "xterm": ()  484x19+2+2  +52+31
     0x800001 "quoted "name" here": ("a" "A")  10x10+-5+-7  +-5+-7
     0x900001 "unmanaged": ("u" "U")  10x10+0+0  +0+0
     0xbad "garbage
-- states
0x40001b Normal
0x60000c Normal
0x600011
0x800001 Normal
0x900001 Withdrawn
"""


def test_windows_are_the_managed_ones_with_absolute_geometry() -> None:
    wins = guestdesktop.parse_windows(TREE)
    assert [(w.id, w.title, w.x, w.y, w.width, w.height) for w in wins] == [
        ("0x40001b", "xmessage", 2, 2, 90, 54),
        ("0x60000c", "xterm", 52, 52, 484, 316),
        ("0x800001", 'quoted "name" here', -5, -7, 10, 10),
    ]


def test_windows_off_the_screen_are_left_out() -> None:
    tree = (
        '     0x1 "panel": ("p" "P")  1280x27+0+0  +0+0\n'
        '     0x2 "helper": ("h" "H")  3x3+-9999+-9999  +-9999+-9999\n'
        '     0x3 "half": ("h" "H")  100x100+-50+-50  +-50+-50\n'
        '     0x4 "below": ("b" "B")  10x10+0+800  +0+800\n'
    )
    states = "0x1 Normal\n0x2 Normal\n0x3 Normal\n0x4 Normal\n"
    wins = guestdesktop.parse_windows(tree + "-- states\n" + states, (1280, 800))
    assert [w.title for w in wins] == ["panel", "half"]


def test_window_lists_are_bounded() -> None:
    line = '     0x{:x} "{}": ("a" "A")  10x10+0+0  +0+0'
    n = guestdesktop.MAX_WINDOWS + 50
    tree = "\n".join(line.format(i, "t" * 1000) for i in range(n))
    states = "\n".join(f"0x{i:x} Normal" for i in range(n))
    wins = guestdesktop.parse_windows(tree + "\n-- states\n" + states)
    assert len(wins) == guestdesktop.MAX_WINDOWS
    assert len(wins[0].title) == guestdesktop.MAX_TITLE
    assert guestdesktop.parse_windows("no tree at all") == []


APPS = """== debian-xterm.desktop
Name=XTerm
Name=Another name
Exec=xterm %U
Type=Application
== org.gnome.Hidden.desktop
Name=Hidden one
Exec=hidden
Hidden=true
== link.desktop
Name=A link
Exec=xdg-open http://x
Type=Link
== libreoffice-calc.desktop
Name=LibreOffice Calc
Exec=/usr/bin/libreoffice --calc %%U %f
== broken.desktop
Exec=no-name
"""


def test_apps_from_desktop_entries() -> None:
    apps = guestdesktop.parse_apps(APPS)
    assert [(a.id, a.name, a.command) for a in apps] == [
        ("debian-xterm", "XTerm", "xterm"),
        ("libreoffice-calc", "LibreOffice Calc", "/usr/bin/libreoffice --calc %U"),
    ]


@pytest.mark.parametrize(
    ("wanted", "found"),
    [
        ("debian-xterm", "debian-xterm"),
        ("XTERM", "debian-xterm"),  # its name, any case
        ("libreoffice", "libreoffice-calc"),  # its program
        ("LibreOffice Calc", "libreoffice-calc"),
    ],
)
def test_apps_are_picked_by_id_name_or_program(wanted: str, found: str) -> None:
    assert guestdesktop.pick_app(guestdesktop.parse_apps(APPS), wanted).id == found


def test_an_app_that_is_not_installed_is_named_with_the_ones_that_are() -> None:
    with pytest.raises(InvalidArgument) as e:
        guestdesktop.pick_app(guestdesktop.parse_apps(APPS), "gimp")
    assert e.value.field == "app" and "debian-xterm, libreoffice-calc" in str(e.value)


@pytest.mark.parametrize("app", ["", "-rf", "x; rm -rf /", "a" * 129, "$(id)", "../bin/sh"])
def test_launch_requests_take_names_only(app: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        validated(LaunchRequest, {"app": app})
    assert e.value.field == "app"
