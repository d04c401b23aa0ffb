"""The default full-VM image: a Debian desktop an agent can drive.

Two layers, so each is versioned and cached on its own:
- base `debian-desktop:bookworm`: debootstrap minbase with X.Org (the
  modesetting driver on the VM's bochs DRM, evdev input), twm, xterm and
  the X utilities;
- toolkit `corral-desktop:<version>`: `/etc/corral/session`, which the
  guest's init starts on a full VM (it writes an xorg.conf for the VM's
  devices, starts X, sets the background, starts twm and a launcher), and
  twm's configuration.

The desktop: a plain background (DESKTOP_RGB), a "Terminal" launcher
button in the top-left corner (xmessage, restarted after each click: a
click opens an xterm), twm around the windows. Deliberately small: no
display manager, no D-Bus, no session bus; everything is in the session
script.
"""

from __future__ import annotations

import hashlib
import shutil

from corral.images.build import build_debootstrap, build_from_dir
from corral.images.layer import Layer
from corral.images.store import ImageStore, ProgressFn

BASE = "debian-desktop:bookworm"
TOOLKIT = "corral-desktop:latest"  # also tagged with its version
PACKAGES = [
    "xserver-xorg-core",
    "xserver-xorg-input-evdev",
    "xterm",
    "twm",
    "xfonts-base",
    "x11-xserver-utils",
    "x11-utils",
    # A container desktop's X server (no devices: a framebuffer in a file)
    # and its input (XTEST), runtimes/container/xscreen.py.
    "xvfb",
    "xdotool",
    # A container desktop's live view: x11vnc per view (runtimes/vnc.py).
    "x11vnc",
]
DESKTOP_RGB = (0x3B, 0x6E, 0x8F)
# What a desktop session writes once it has drawn (node/lifecycle.py waits).
SESSION_PATH = "/etc/corral/session"
DRAWN_PATH = "/run/corral/desktop-drawn"

X_START = """#!/bin/sh
# A Corral desktop: on a full VM started by the guest's init, in a container
# by the node (with CORRAL_XVFB=WIDTHxHEIGHT). X first.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/root DISPLAY=:0 LANG=C.UTF-8
if [ -n "$CORRAL_XVFB" ]; then
  # A container has no screen device: Xvfb keeps the screen in a file
  # (XWD) the node reads, and takes input through XTEST (xdotool).
  mkdir -p /run/corral/fb /var/log
  Xvfb :0 -screen 0 "${CORRAL_XVFB}x24" -fbdir /run/corral/fb -nolisten tcp -noreset \\
    >/var/log/corral-x.log 2>&1 &
else
# No udev in the guest: find the VM's keyboard and tablet by name.
kbd="" ptr=""
for i in $(seq 1 100); do
  for e in /sys/class/input/event*; do
    case "$(cat $e/device/name 2>/dev/null)" in
      *Keyboard*) kbd=/dev/input/${e##*/} ;;
      *Tablet*) ptr=/dev/input/${e##*/} ;;
    esac
  done
  [ -n "$kbd" ] && [ -n "$ptr" ] && [ -e /dev/dri/card0 ] && break
  sleep 0.1
done
mkdir -p /dev/input /var/log
[ -e "$kbd" ] || mknod "$kbd" c 13 $((64 + ${kbd##*event}))
[ -e "$ptr" ] || mknod "$ptr" c 13 $((64 + ${ptr##*event}))
cat > /tmp/xorg.conf <<CONF
Section "ServerFlags"
  Option "AutoAddDevices" "false"
  Option "AutoEnableDevices" "false"
EndSection
Section "InputDevice"
  Identifier "keyboard"
  Driver "evdev"
  Option "Device" "$kbd"
EndSection
Section "InputDevice"
  Identifier "tablet"
  Driver "evdev"
  Option "Device" "$ptr"
EndSection
Section "Device"
  Identifier "vga"
  Driver "modesetting"
EndSection
Section "Screen"
  Identifier "screen"
  Device "vga"
EndSection
Section "ServerLayout"
  Identifier "layout"
  Screen "screen"
  InputDevice "keyboard" "CoreKeyboard"
  InputDevice "tablet" "CorePointer"
EndSection
CONF
Xorg :0 -config /tmp/xorg.conf -nolisten tcp -noreset -novtswitch vt1 \\
  >/var/log/corral-x.log 2>&1 &
fi
for i in $(seq 1 300); do xdpyinfo >/dev/null 2>&1 && break; sleep 0.1; done
"""


def drawn_when(test: str) -> str:
    """Shell that writes DRAWN_PATH once `test` succeeds (within 60 s): the
    node's create waits for this file (and for QEMU's framebuffer to show
    more than one colour) before it returns."""
    return f"""(
  for i in $(seq 1 1200); do
    if {test}; then
      mkdir -p /run/corral && : > {DRAWN_PATH}
      break
    fi
    sleep 0.05
  done
) &
"""


TWM_SESSION = """xsetroot -solid "@RGB@"
# twm's fonts are the core "fixed" ones; a UTF-8 locale would want a fontset.
LANG=C twm &
cd /root
@DRAWN_WHEN@while :; do
  # xmessage exits with the clicked button's value (0 here) or fails if X went.
  if xmessage -geometry +0+0 -buttons " Terminal :0" -default " Terminal " "Corral"; then
    xterm -geometry 80x24+120+60 &
  else
    sleep 1
  fi
done
"""

TWMRC = """# twm for Corral's desktop: windows placed where their programs ask,
# no interactive placement (an agent could not answer it).
NoGrabServer
RandomPlacement
UsePPosition "on"
NoTitle { "xmessage" }
TitleFont "fixed"
MenuFont "fixed"
IconFont "fixed"
ResizeFont "fixed"
IconManagerFont "fixed"
"""


def session() -> str:
    """/etc/corral/session of the twm desktop."""
    drawn = drawn_when("xwininfo -name xmessage 2>/dev/null | grep -q IsViewable")
    tail = TWM_SESSION.replace("@RGB@", _hex(DESKTOP_RGB)).replace("@DRAWN_WHEN@", drawn)
    return X_START + tail


def _toolkit_version() -> str:
    text = session() + TWMRC
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _hex(rgb: tuple[int, int, int]) -> str:
    return "#" + "".join(f"{c:02x}" for c in rgb)


def toolkit_ref() -> str:
    return f"corral-desktop:{_toolkit_version()}"


def ensure(store: ImageStore, progress: ProgressFn) -> tuple[Layer, Layer]:
    """Build (or find) the desktop's two layers: (base, toolkit)."""
    base = build_debootstrap(store, "bookworm", PACKAGES, tag=BASE, progress=progress)
    key = f"desktop-session:{_toolkit_version()}"
    found = store.find_by_label("corral.source", key)
    if found is not None:
        store.tag(found.digest, toolkit_ref())
        store.tag(found.digest, TOOLKIT)
        return base, found
    stage = store.tmpdir("desktop")
    try:
        script = stage / "etc" / "corral" / "session"
        script.parent.mkdir(parents=True)
        script.write_text(session())
        script.chmod(0o755)
        (stage / "root").mkdir(mode=0o700)
        (stage / "root" / ".twmrc").write_text(TWMRC)
        toolkit = build_from_dir(
            store,
            stage,
            tag=toolkit_ref(),
            kind="toolkit",
            labels={"corral.source": key},
            progress=progress,
        )
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    store.tag(toolkit.digest, TOOLKIT)
    return base, toolkit
