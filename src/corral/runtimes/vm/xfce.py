"""The full desktop for computer-use agents: XFCE with Chromium, Firefox
ESR, LibreOffice (Calc, Writer), Thunar, Mousepad, xfce4-terminal,
Ristretto and fonts for the common scripts.

Two layers, like the small desktop (desktop.py):
- base `debian-xfce:bookworm`: built by Corral's own Dockerfile builder
  from desktop-files/xfce.Dockerfile (FROM the small desktop's base, one
  `apt-get install` of Debian's packages);
- toolkit `corral-xfce:<version>`: the session (X as in desktop.py, then
  D-Bus and xfce4-session), XFCE's settings for a machine an agent drives
  (no compositor: TCG draws every frame in software; a plain background;
  the default panel without its first-run question), Chromium's flags (it
  runs as the VM's root: its own sandbox is off, the VM is the sandbox)
  and LibreOffice without its first-start dialogs.

Drawn: the panel's plugins are laid out and the desktop window is mapped
(then the node waits for the screen to settle, runtime.py wait_drawn).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from corral.images.build import build_from_dir
from corral.images.layer import Layer
from corral.images.store import ImageStore, ProgressFn
from corral.runtimes.vm.desktop import X_START, drawn_when

BASE = "debian-xfce:bookworm"
TOOLKIT = "corral-xfce:latest"  # also tagged with its version
DOCKERFILE = Path(__file__).with_name("desktop-files") / "xfce.Dockerfile"
BACKGROUND_RGB = (0x2E, 0x4A, 0x62)

SESSION_TAIL = """export XDG_RUNTIME_DIR=/run/user/0 XDG_SESSION_TYPE=x11 XDG_CURRENT_DESKTOP=XFCE
mkdir -p -m 700 /run/user/0
xsetroot -solid "@RGB@"
conf=/root/.config/xfce4/xfconf/xfce-perchannel-xml
# The panel's default layout, so it never asks which one on first start.
[ -f $conf/xfce4-panel.xml ] || cp /etc/xdg/xfce4/panel/default.xml $conf/xfce4-panel.xml
cd /root
@DRAWN_WHEN@exec dbus-launch --exit-with-session xfce4-session
"""

XFWM4 = """<?xml version="1.0" encoding="UTF-8"?>
<channel name="xfwm4" version="1.0">
  <property name="general" type="empty">
    <property name="use_compositing" type="bool" value="false"/>
    <property name="theme" type="string" value="Default"/>
  </property>
</channel>
"""

# A plain background, no wallpaper image, on the VM's monitor (the
# modesetting driver names it Virtual-1) and a container's (Xvfb's "screen").
MONITOR = """      <property name="monitor@NAME@" type="empty">
        <property name="workspace0" type="empty">
          <property name="color-style" type="int" value="0"/>
          <property name="image-style" type="int" value="0"/>
          <property name="rgba1" type="array">
@RGBA@
          </property>
        </property>
      </property>
"""
DESKTOP = """<?xml version="1.0" encoding="UTF-8"?>
<channel name="xfce4-desktop" version="1.0">
  <property name="backdrop" type="empty">
    <property name="screen0" type="empty">
@MONITORS@    </property>
  </property>
</channel>
"""

CHROMIUM_FLAGS = """# Corral: Chromium runs as the VM's root; the VM is its sandbox (--test-type: no
# infobar about --no-sandbox over the page an agent reads).
export CHROMIUM_FLAGS="$CHROMIUM_FLAGS --no-sandbox --disable-gpu --disable-dev-shm-usage \\
  --no-first-run --no-default-browser-check --password-store=basic --test-type"
"""

LIBREOFFICE = """<?xml version="1.0" encoding="UTF-8"?>
<oor:items xmlns:oor="http://openoffice.org/2001/registry"
    xmlns:xs="http://www.w3.org/2001/XMLSchema" xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance">
<item oor:path="/org.openoffice.Office.Common/Misc"><prop oor:name="ShowTipOfTheDay" oor:op="fuse"><value>false</value></prop></item>
<item oor:path="/org.openoffice.Office.Common/Misc"><prop oor:name="FirstRun" oor:op="fuse"><value>false</value></prop></item>
<item oor:path="/org.openoffice.Setup/Office"><prop oor:name="ooSetupInstCompleted" oor:op="fuse"><value>true</value></prop></item>
<item oor:path="/org.openoffice.Office.Common/Save/Document"><prop oor:name="WarnAlienFormat" oor:op="fuse"><value>false</value></prop></item>
</oor:items>
"""  # noqa: E501


def _hex(rgb: tuple[int, int, int]) -> str:
    return "#" + "".join(f"{c:02x}" for c in rgb)


def files() -> dict[str, str]:
    """The toolkit's files, by path in the guest."""
    # The panel is laid out once its plugins' windows have real sizes (at
    # first they are 1x1 on a black panel); the desktop window is mapped.
    drawn = drawn_when(
        "xwininfo -name xfce4-panel -tree 2>/dev/null"
        " | grep -q '\"wrapper-2.0\".* [0-9][0-9]*x[0-9][0-9]'"
        " && xwininfo -name Desktop 2>/dev/null | grep -q IsViewable"
    )
    rgba = "\n".join(
        f'            <value type="double" value="{c / 255:.4f}"/>' for c in (*BACKGROUND_RGB, 255)
    )
    tail = SESSION_TAIL.replace("@RGB@", _hex(BACKGROUND_RGB)).replace("@DRAWN_WHEN@", drawn)
    conf = "root/.config/xfce4/xfconf/xfce-perchannel-xml"
    return {
        "etc/corral/session": X_START + tail,
        f"{conf}/xfwm4.xml": XFWM4,
        f"{conf}/xfce4-desktop.xml": DESKTOP.replace(
            "@MONITORS@",
            "".join(MONITOR.replace("@NAME@", n) for n in ("Virtual-1", "screen")),
        ).replace("@RGBA@", rgba),
        "etc/chromium.d/corral": CHROMIUM_FLAGS,
        "root/.config/libreoffice/4/user/registrymodifications.xcu": LIBREOFFICE,
    }


def _version() -> str:
    text = "\0".join(f"{k}\0{v}" for k, v in sorted(files().items()))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def toolkit_ref() -> str:
    return f"corral-xfce:{_version()}"


def ensure_toolkit(store: ImageStore, progress: ProgressFn) -> Layer:
    """Build (or find) the session's toolkit layer."""
    key = f"xfce-session:{_version()}"
    found = store.find_by_label("corral.source", key)
    if found is not None:
        store.tag(found.digest, toolkit_ref())
        store.tag(found.digest, TOOLKIT)
        return found
    stage = store.tmpdir("xfce")
    try:
        for rel, text in files().items():
            path = stage / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        (stage / "etc" / "corral" / "session").chmod(0o755)
        (stage / "root").chmod(0o700)
        toolkit = build_from_dir(
            store, stage, tag=toolkit_ref(), kind="toolkit",
            labels={"corral.source": key}, progress=progress,
        )  # fmt: skip
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    store.tag(toolkit.digest, TOOLKIT)
    return toolkit
