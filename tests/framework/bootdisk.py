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
Escape goes back to the menu. Entry 4 (key l) boots Linux (Debian's
kernel, the one the microVMs use, with a busybox initramfs): it stands in
for an OS's network manager, asking for an address by DHCP whenever its
NIC's carrier comes up, and writes each carrier change and lease to the
serial port (CARRIER 0/1, LEASE <address> ...).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from corral.runtimes.vm import guest

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
menuentry "Corral disk: linux" --hotkey=l {{
  linux /boot/vmlinuz console=ttyS0 quiet panic=-1
  initrd /boot/linux.cpio
}}
"""

# The initramfs's /init: what a network manager does, in a loop.
LINUX_INIT = r"""#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /etc/modules); do insmod /lib/$m.ko; done
ip link set lo up
ip link set eth0 up
echo LINUX UP
last=
while :; do
  c=$(cat /sys/class/net/eth0/carrier 2>/dev/null || echo 0)
  if [ "$c" != "$last" ]; then
    echo "CARRIER $c"
    last=$c
    [ "$c" = 1 ] && udhcpc -i eth0 -q -n -t 20 -T 1 -s /lease.sh
  fi
  sleep 0.2
done
"""
LEASE_SCRIPT = """#!/bin/sh
case "$1" in bound|renew)
  ip addr flush dev "$interface"
  ip addr add "$ip/$mask" dev "$interface"
  echo "LEASE $ip router $router dns $dns";;
esac
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
    _linux(tree / "boot")
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


def _linux(boot: Path) -> None:
    """boot/vmlinuz and boot/linux.cpio: the kernel package the install
    downloaded for the microVMs (build/guest/debs), its e1000 driver, and
    static busybox."""
    debs = sorted((guest.DEFAULT_OUT / "debs").glob("linux-image-*.deb"))
    if not debs:
        raise RuntimeError(f"no kernel package in {guest.DEFAULT_OUT / 'debs'} (make install)")
    with tempfile.TemporaryDirectory(prefix="bootdisk-") as tmp:
        k = Path(tmp)
        # Only what is used: the package unpacks to ~400 MB.
        with subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(debs[-1])],
                              stdout=subprocess.PIPE) as tar:  # fmt: skip
            subprocess.run(["tar", "-x", "-C", str(k), "--wildcards", "./boot/vmlinuz-*",
                            "./lib/modules/*/kernel/drivers/net/ethernet/intel/e1000/*"],
                           stdin=tar.stdout, check=True)  # fmt: skip
        shutil.copy(next((k / "boot").glob("vmlinuz-*")), boot / "vmlinuz")
        modules = guest.module_closure(k / "lib", ["e1000"])
        names = [m.name.split(".ko")[0] for m in modules]
        entries: list[tuple[str, int, bytes]] = [
            (d, 0o040755, b"") for d in ("bin", "dev", "etc", "lib", "proc", "sys", "tmp")
        ]
        entries += [
            ("bin/busybox", 0o100755, Path("/bin/busybox").read_bytes()),
            ("init", 0o100755, LINUX_INIT.encode()),
            ("lease.sh", 0o100755, LEASE_SCRIPT.encode()),
            ("etc/modules", 0o100644, "\n".join(names).encode() + b"\n"),
            *(
                (f"lib/{n}.ko", 0o100644, guest.decompressed(m))
                for n, m in zip(names, modules, strict=True)
            ),
        ]
        (boot / "linux.cpio").write_bytes(guest.cpio_newc(entries))


def _run(*argv: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed: {proc.stderr[-800:]}")
