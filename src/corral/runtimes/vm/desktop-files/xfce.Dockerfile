# Corral's full desktop for computer-use agents: XFCE with a browser (two),
# an office suite, a file manager, an editor, a terminal, an image viewer and
# fonts for the common scripts, from Debian's packages, on the small desktop
# base (X.Org, twm, xterm, the X utilities). Built by the install script:
#   corral image build debian-xfce:bookworm --desktop xfce
# (its session, corral-xfce, is the toolkit runtimes/vm/xfce.py makes).
FROM debian-desktop:bookworm
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
    dbus-x11 xfce4-session xfwm4 xfdesktop4 xfce4-panel xfce4-settings xfconf thunar \
    mousepad xfce4-terminal ristretto wmctrl adwaita-icon-theme \
    chromium firefox-esr libreoffice-calc libreoffice-writer libreoffice-gtk3 \
    fonts-dejavu-core fonts-liberation2 fonts-noto-core fonts-noto-cjk python3 \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
