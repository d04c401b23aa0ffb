"""The desktops' session toolkits, as files: what the guest's init runs
and the settings an agent's desktop needs."""

from __future__ import annotations

from corral.runtimes.vm import desktop, xfce


def test_both_sessions_start_x_and_say_when_they_are_drawn() -> None:
    for script in (desktop.session(), xfce.files()["etc/corral/session"]):
        assert script.startswith("#!/bin/sh\n") and "Xorg :0" in script
        assert f": > {desktop.DRAWN_PATH}" in script
        assert "@" not in script  # every placeholder filled
    assert "xwininfo -name xmessage" in desktop.session()
    assert (
        "exec dbus-launch --exit-with-session xfce4-session" in xfce.files()["etc/corral/session"]
    )


def test_the_xfce_toolkit_configures_a_desktop_for_agents() -> None:
    files = xfce.files()
    conf = "root/.config/xfce4/xfconf/xfce-perchannel-xml"
    assert '"use_compositing" type="bool" value="false"' in files[f"{conf}/xfwm4.xml"]
    assert "monitorVirtual-1" in files[f"{conf}/xfce4-desktop.xml"]
    assert "--no-sandbox" in files["etc/chromium.d/corral"]
    assert "--test-type" in files["etc/chromium.d/corral"]
    assert "ShowTipOfTheDay" in files["root/.config/libreoffice/4/user/registrymodifications.xcu"]
    assert (
        xfce.DOCKERFILE.is_file() and "FROM debian-desktop:bookworm" in xfce.DOCKERFILE.read_text()
    )


def test_toolkit_versions_follow_their_files() -> None:
    assert xfce.toolkit_ref() == xfce.toolkit_ref()
    assert xfce.toolkit_ref().startswith("corral-xfce:") and len(xfce.toolkit_ref()) == 24
    assert desktop.toolkit_ref().startswith("corral-desktop:")
