"""A small disk an OS would be on, built from Debian's packages: GRUB
(BIOS and UEFI, grub-mkrescue's hybrid image) showing a menu, plus a FAT
partition GRUB writes its environment block to. It stands in for a
user's own disk (a Windows install) in the tests and the benchmark: no
Corral agent, driven through the screen alone, and a write the guest
makes that must land in the sandbox's overlay and never in the disk.

Menu entry 1 shows the state GRUB read from the FAT partition at boot;
entry 2 writes "written" there (save_env) and says WROTE; entry 3 (UEFI,
with the firmware's network driver; key n) asks for an address by DHCP,
looks a name up, and writes what it got to the serial port as well;
Escape goes back to the menu.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

TOOLS = ("grub-mkrescue", "xorriso", "mformat", "mcopy", "grub-editenv", "qemu-img")
LABEL = "CORRALENV"
GRUB_CFG = f"""\
set timeout=-1
search --no-floppy --label {LABEL} --set=env
load_env -f ($env)/grubenv
menuentry "Corral disk: state ${{corral_state}}" {{ echo state ${{corral_state}}; sleep 100000 }}
menuentry "Corral disk: write" {{
  set corral_state=written
  save_env -f ($env)/grubenv corral_state
  echo WROTE
  sleep 100000
}}
menuentry "Corral disk: network" --hotkey=n {{
  serial --unit=0 --speed=115200
  terminal_output --append serial
  insmod efinet
  net_bootp
  net_ls_addr
  net_ls_routes
  echo dns:
  net_ls_dns
  net_nslookup corral-denied.example
  echo NETDONE
  sleep --interruptible 100000
}}
"""


def missing_tools() -> str | None:
    gone = [t for t in TOOLS if shutil.which(t) is None]
    if gone:
        return (
            f"requires {', '.join(gone)} to build the test disk (apt install grub-pc-bin "
            "grub-efi-amd64-bin grub-common xorriso mtools qemu-utils)"
        )
    return None


def build(workdir: Path) -> tuple[Path, Path]:
    """(raw disk, the same as qcow2), built in `workdir`."""
    tree = workdir / "tree"
    (tree / "boot" / "grub").mkdir(parents=True, exist_ok=True)
    (tree / "boot" / "grub" / "grub.cfg").write_text(GRUB_CFG)
    env = workdir / "grubenv"
    fat = workdir / "env.fat"
    raw = workdir / "grub-disk.img"
    qcow2 = workdir / "grub-disk.qcow2"
    for path in (env, fat, raw, qcow2):
        path.unlink(missing_ok=True)
    _run("grub-editenv", str(env), "create")
    _run("mformat", "-i", str(fat), "-v", LABEL, "-C", "-T", "8192", "-h", "2", "-s", "32", "::")
    _run("mcopy", "-i", str(fat), str(env), "::/grubenv")
    # The FAT partition is appended to the image's partition tables.
    _run(
        "grub-mkrescue", "-o", str(raw), str(tree), "--", "-append_partition", "3", "0x0c", str(fat)
    )
    _run("qemu-img", "convert", "-O", "qcow2", str(raw), str(qcow2))
    return raw, qcow2


def _run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed: {proc.stderr[-800:]}")
