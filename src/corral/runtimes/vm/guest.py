"""The guest's kernel and initramfs: platform artefacts, built from Debian
packages and Corral's own agent, versioned by their inputs.

- Kernel: Debian's `linux-image-<abi>-amd64`, downloaded with apt (not
  installed on the host), its bzImage unpacked to the uncompressed ELF
  `vmlinux`: under TCG the PVH entry of an ELF kernel skips the 3.5 s the xz
  decompressor takes (../shared/HOST-NOTES.md).
- Initramfs (newc cpio): static busybox, the kernel modules a guest needs
  (Debian builds virtio, erofs and overlay as modules) in dependency order,
  the static corral-init, and `/init`, which loads them, mounts the image's
  layers and execs corral-init on the agent's serial port.

The build goes to <out>/<version>/, where version is a hash of every input
(the kernel package's name and version, busybox, corral-init, the init
script, the module list); an existing version is reused, so the install
script rebuilds only when an input changes.
"""

from __future__ import annotations

import hashlib
import io
import lzma
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from corral.errors import Unavailable
from corral.log import get_logger

log = get_logger("corral.vm.guest")

REPO = Path(__file__).resolve().parents[4]
DEFAULT_OUT = REPO / "build" / "guest"
AGENT_PORT = "corral.agent"
# What a guest loads, besides what these need (modules.dep adds the rest).
MODULES = [
    "virtio_mmio",
    "virtio_pci",
    "virtio_console",
    "virtio_blk",
    "virtio_balloon",
    # libcrc32c (erofs needs it) asks the crypto API for crc32c at load, and
    # an initramfs has no modprobe to fetch it: load an implementation first.
    "crc32c_generic",
    "erofs",
    "overlay",
]
# A full VM's display and input, loaded only with corral.display=1: DRM is
# over 2 MB of module code a microVM would load for nothing.
DISPLAY_MODULES = ["bochs", "virtio_input", "evdev"]
# A layer on virtio-pmem (corral.pmem=<layer index>), mounted with DAX.
PMEM_MODULES = ["libnvdimm", "nd_btt", "nd_pmem", "nd_virtio", "virtio_pmem"]
# A NIC (corral.ip=<address> corral.gw=<gateway>): the sandbox's egress;
# tcp_diag for corral-netmove, which aborts a copy's connections out
# (docs/network-copies.md).
NET_MODULES = ["virtio_net", "tcp_diag"]

# An initramfs's first steps: busybox's commands, the kernel's file
# systems, the modules /etc/modules.order lists (dependencies first).
BOOT = """/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /etc/modules.order); do insmod /lib/modules/$m.ko 2>/dev/null; done
"""

INIT = (
    """#!/bin/busybox sh
# Corral guest init: modules, the image's layers, then the agent as PID 1.
"""
    + BOOT
    + """display=0
grep -q "corral.display=1" /proc/cmdline && display=1
if [ "$display" = 1 ]; then
  for m in $(cat /etc/modules.display); do insmod /lib/modules/$m.ko 2>/dev/null; done
fi
ip link set lo up
ip=$(sed -n "s/.*corral.ip=\\([0-9.]*\\).*/\\1/p" /proc/cmdline)
if [ -n "$ip" ]; then
  # The NIC is a tap bridged to the sandbox's veth on the host: the guest
  # holds the sandbox's address; the host's policy filters it as a container's.
  for m in $(cat /etc/modules.net); do insmod /lib/modules/$m.ko 2>/dev/null; done
  gw=$(sed -n "s/.*corral.gw=\\([0-9.]*\\).*/\\1/p" /proc/cmdline)
  ip link set eth0 up && ip addr add "$ip/30" dev eth0 && ip route add default via "$gw" \\
    || echo "corral: network setup failed"
fi
pmem=$(sed -n "s/.*corral.pmem=\\([0-9]*\\).*/\\1/p" /proc/cmdline)
if [ -n "$pmem" ]; then
  for m in $(cat /etc/modules.pmem); do insmod /lib/modules/$m.ko 2>/dev/null; done
  for i in $(seq 1 100); do [ -b /dev/pmem0 ] && break; sleep 0.05; done
fi
port=""
for i in $(seq 1 100); do
  for d in /sys/class/virtio-ports/*; do
    [ "$(cat $d/name 2>/dev/null)" = "corral.agent" ] && port=/dev/${d##*/}
  done
  [ -n "$port" ] && break
  sleep 0.05
done
[ -n "$port" ] || { echo "corral: no agent port"; poweroff -f; }
arg() { sed -n "s/.*$1=\\([0-9]*\\).*/\\1/p" /proc/cmdline; }
drive() {
  for b in /sys/block/vd*; do
    [ "$(cat $b/serial 2>/dev/null)" = "$1" ] && echo /dev/${b##*/}
  done
}
n=$(arg corral.layers)
if [ -n "$n" ] && [ "$n" -gt 0 ]; then
  # The image: layer 0 is the topmost. Each is an EROFS metadata image and,
  # when it has data, the blob of its chunks; an overlay with a writable
  # upper of corral.disk bytes goes on top.
  lower=""
  i=0
  while [ "$i" -lt "$n" ]; do
    mkdir -p /layers/$i
    if [ "$i" = "$pmem" ]; then
      # One flat image on the host's page cache, mapped by every VM that
      # reads it (DAX): no copy of its pages in this guest's memory.
      mount -t erofs -o ro,dax=always /dev/pmem0 /layers/$i \
        || { echo "corral: layer $i on pmem"; poweroff -f; }
    else
      m=$(drive l${i}m)
      b=$(drive l${i}b)
      if [ -n "$b" ]; then opts="ro,device=$b"; else opts="ro"; fi
      mount -t erofs -o "$opts" "$m" /layers/$i || { echo "corral: layer $i"; poweroff -f; }
    fi
    lower="$lower${lower:+:}/layers/$i"
    i=$((i + 1))
  done
  mkdir -p /rw /newroot
  mount -t tmpfs -o size=$(arg corral.disk),mode=0755 rw /rw
  mkdir -p /rw/upper /rw/work
  mount -t overlay -o "lowerdir=$lower,upperdir=/rw/upper,workdir=/rw/work" overlay /newroot
  # The agent comes from the platform, not the image: a read-only /.corral.
  mkdir -p /newroot/.corral /newroot/proc /newroot/sys /newroot/dev /newroot/tmp
  mount -t tmpfs -o size=8m,mode=0755 corral /newroot/.corral
  cp -a /platform/bin /newroot/.corral/bin
  mount -o remount,ro /newroot/.corral
  mount --move /dev /newroot/dev
  mkdir -p /newroot/dev/pts /newroot/dev/shm
  mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /newroot/dev/pts
  mount -t tmpfs -o mode=1777 shm /newroot/dev/shm
  mount --move /proc /newroot/proc
  mount --move /sys /newroot/sys
  mount -t tmpfs -o mode=1777 tmp /newroot/tmp
  mknod /dev/null c 1 3  # the initramfs's own, for the shell's redirections
  if [ "$display" = 1 ] && [ -x /newroot/etc/corral/session ]; then
    # A full VM's desktop, from the image: started here so it outlives any
    # agent connection (corral-init, PID 1 from the next line, reaps it).
    setsid chroot /newroot /etc/corral/session </newroot/dev/null \
      >/newroot/tmp/corral-session.log 2>&1 &
    # switch_root empties the initramfs, /bin/chroot included: go on only
    # once the child has chrooted (its root is then /newroot), or it may
    # find no chroot to exec (seen with four VMs booting at once).
    s=$!
    for i in $(seq 1 200); do
      [ "$(readlink /newroot/proc/$s/root)" = /newroot ] && break
      [ -e /newroot/proc/$s ] || break
      sleep 0.01
    done
  fi
  echo "corral: agent on $port, root of $n layers"
  exec switch_root /newroot /.corral/bin/corral-init --serial "$port"
fi
echo "corral: agent on $port"
exec /corral-init --serial "$port"
"""
)


@dataclass(frozen=True)
class GuestArtefacts:
    version: str
    kernel: Path  # uncompressed ELF vmlinux
    initrd: Path
    kernel_release: str


def _run(*argv: str, cwd: Path | None = None) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, cwd=cwd)
    if r.returncode != 0:
        raise Unavailable(f"{' '.join(argv)} failed: {r.stderr.strip()[-500:]}")
    return r.stdout


def kernel_package() -> tuple[str, str]:
    """(package, version) of the kernel Debian's linux-image-amd64 points at."""
    deps = _run("apt-cache", "depends", "linux-image-amd64")
    m = re.search(r"Depends: (linux-image-[0-9][^\s]*-amd64)", deps)
    if m is None:
        raise Unavailable("apt knows no linux-image-amd64: is this Debian with apt sources?")
    name = m.group(1)
    policy = _run("apt-cache", "policy", name)
    v = re.search(r"Candidate: (\S+)", policy)
    return name, v.group(1) if v else "unknown"


def extract_vmlinux(bzimage: bytes) -> bytes:
    """The ELF kernel inside a bzImage: xz (bookworm's 6.1) or zstd (its 6.12)."""
    at = bzimage.find(b"\xfd7zXZ\x00")
    if at >= 0:
        elf = lzma.LZMADecompressor().decompress(bzimage[at:])
    else:
        at = bzimage.find(b"\x28\xb5\x2f\xfd")
        if at < 0:
            raise Unavailable("the kernel image has no xz or zstd payload (not a Debian bzImage?)")
        # zstd stops at the end of its frame and complains about the bytes
        # the bzImage has after it: the frame's output is what counts.
        elf = subprocess.run(
            ["zstd", "-dcq"], input=bzimage[at:], capture_output=True, check=False
        ).stdout
    if not elf.startswith(b"\x7fELF"):
        raise Unavailable("the kernel's payload is not an ELF image")
    return elf


def module_closure(modules_dir: Path, wanted: list[str]) -> list[Path]:
    """`wanted` and what they depend on, dependencies first. Dependencies
    come from each module's own .modinfo (`depends=`): a package's tree has
    no modules.dep (depmod writes it at install time)."""
    by_name = {f.name.split(".ko")[0].replace("-", "_"): f for f in modules_dir.rglob("*.ko*")}
    order: list[Path] = []

    def visit(name: str) -> None:
        path = by_name.get(name)
        if path is None or path in order:
            return  # built in to this kernel, or already placed
        found = re.search(rb"(?:^|\x00)depends=([^\x00]*)\x00", decompressed(path))
        for dep in found.group(1).decode().split(",") if found else []:
            if dep:
                visit(dep.replace("-", "_"))
        order.append(path)

    for name in wanted:
        visit(name)
    return order


def cpio_newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc archive of (name, mode, data); a symlink's data is its target."""
    out = io.BytesIO()

    def pad(n: int) -> None:
        out.write(b"\0" * ((4 - n % 4) % 4))

    for ino, (name, mode, data) in enumerate([*entries, ("TRAILER!!!", 0, b"")], start=1):
        raw = name.encode() + b"\0"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(raw), 0]
        head = b"070701" + b"".join(f"{f:08x}".encode() for f in fields)
        out.write(head + raw)
        pad(len(head) + len(raw))
        out.write(data)
        pad(len(data))
    return out.getvalue()


def decompressed(path: Path) -> bytes:
    data = path.read_bytes()
    if path.suffix == ".xz":
        return lzma.decompress(data)
    if path.suffix == ".zst":
        return subprocess.run(["zstd", "-dc", str(path)], capture_output=True, check=True).stdout
    return data


def build(out: Path = DEFAULT_OUT, agent: Path | None = None) -> GuestArtefacts:
    """Build (or find) the guest artefacts for the current inputs."""
    agent = agent or REPO / "build" / "platform" / "bin" / "corral-init"
    watch = agent.parent / "corral-watch"
    netmove = agent.parent / "corral-netmove"
    from corral.host.platform import BASH_CANDIDATES

    busybox = Path("/bin/busybox")
    bash = next((b for b in BASH_CANDIDATES if b.is_file()), Path("/bin/bash-static"))
    for need, how in (
        (agent, "make -C native"),
        (watch, "make -C native"),
        (netmove, "make -C native"),
        (busybox, "apt install busybox-static"),
        (bash, "apt install bash-static"),
    ):
        if not need.exists():
            raise Unavailable(f"{need} is missing ({how})")
    package, pkg_version = kernel_package()
    h = hashlib.sha256()
    lists = "|".join(" ".join(x) for x in (MODULES, DISPLAY_MODULES, PMEM_MODULES, NET_MODULES))
    for part in (package, pkg_version, INIT, lists):
        h.update(part.encode() + b"\0")
    h.update(hashlib.sha256(agent.read_bytes()).digest())
    h.update(hashlib.sha256(busybox.read_bytes()).digest())
    h.update(hashlib.sha256(bash.read_bytes()).digest())
    h.update(hashlib.sha256(watch.read_bytes()).digest())
    h.update(hashlib.sha256(netmove.read_bytes()).digest())
    version = h.hexdigest()[:16]
    target = out / version
    done = GuestArtefacts(version, target / "vmlinux", target / "initrd.cpio", _release_of(target))
    if (target / "ready").exists():
        return done
    log.info("guest.build", version=version, kernel=f"{package} {pkg_version}")
    with tempfile.TemporaryDirectory(prefix="corral-guest-") as tmp:
        work = Path(tmp)
        debs = out / "debs"
        debs.mkdir(parents=True, exist_ok=True)
        deb = next(iter(sorted(debs.glob(f"{package}_*.deb"))), None)
        if deb is None:
            _run("apt-get", "download", package, cwd=debs)
            deb = next(iter(sorted(debs.glob(f"{package}_*.deb"))))
        _run("dpkg-deb", "-x", str(deb), str(work / "k"))
        release = package.removeprefix("linux-image-")
        bz = next((work / "k" / "boot").glob("vmlinuz-*"))
        modules_dir = work / "k" / "lib" / "modules" / release / "kernel"
        mods = module_closure(modules_dir, MODULES)
        display_mods = [m for m in module_closure(modules_dir, DISPLAY_MODULES) if m not in mods]
        pmem_mods = [m for m in module_closure(modules_dir, PMEM_MODULES) if m not in mods]
        net_mods = [m for m in module_closure(modules_dir, NET_MODULES) if m not in mods]
        entries: list[tuple[str, int, bytes]] = [
            (d, 0o040755, b"")
            for d in (
                *("bin", "dev", "etc", "proc", "sys", "tmp", "lib", "lib/modules", "mnt"),
                *("platform", "platform/bin"),
            )
        ]
        entries += [
            ("bin/busybox", 0o100755, busybox.read_bytes()),
            ("init", 0o100755, INIT.encode()),
            ("corral-init", 0o100755, agent.read_bytes()),
            # The platform layer a container gets at /.corral, for the guest's.
            ("platform/bin/corral-init", 0o100555, agent.read_bytes()),
            ("platform/bin/busybox", 0o100555, busybox.read_bytes()),
            ("platform/bin/bash", 0o100555, bash.read_bytes()),
            ("platform/bin/corral-watch", 0o100555, watch.read_bytes()),
            ("platform/bin/corral-netmove", 0o100555, netmove.read_bytes()),
            ("platform/bin/sh", 0o120777, b"busybox"),
            ("etc/passwd", 0o100644, b"root:x:0:0:root:/root:/bin/sh\n"),
            ("etc/group", 0o100644, b"root:x:0:\n"),
        ]
        for listing, group in (
            ("modules.order", mods),
            ("modules.display", display_mods),
            ("modules.pmem", pmem_mods),
            ("modules.net", net_mods),
        ):
            names = []
            for m in group:
                name = m.name.split(".ko")[0]
                names.append(name)
                entries.append((f"lib/modules/{name}.ko", 0o100644, decompressed(m)))
            entries.append((f"etc/{listing}", 0o100644, ("\n".join(names) + "\n").encode()))
        staging = out / f".{version}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        (staging / "vmlinux").write_bytes(extract_vmlinux(bz.read_bytes()))
        (staging / "initrd.cpio").write_bytes(cpio_newc(entries))
        (staging / "release").write_text(release + "\n")
        (staging / "ready").write_text(f"{package} {pkg_version}\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
        # Older versions go: a running guest has its kernel and initramfs in
        # memory already, and no new one will ask for them.
        for old in out.iterdir():
            if old.name not in (version, "debs") and not old.name.startswith("."):
                shutil.rmtree(old, ignore_errors=True)
    return GuestArtefacts(version, target / "vmlinux", target / "initrd.cpio", _release_of(target))


def _release_of(target: Path) -> str:
    f = target / "release"
    return f.read_text().strip() if f.exists() else ""


if __name__ == "__main__":
    # The install script builds the artefacts ahead of the first microVM.
    built = build()
    print(f"guest {built.version}: kernel {built.kernel_release}, {built.kernel}, {built.initrd}")
