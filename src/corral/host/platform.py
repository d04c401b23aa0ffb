"""The platform layer: the read-only tree every sandbox sees at /.corral.

It holds corral-init (PID 1 and exec server), a static bash that runs every
command given as a string, and a static busybox for the platform's own file
operations (tar). Nothing the platform executes inside a sandbox comes from
the image, so an agent that replaces /bin/sh or /bin/bash can only fool
itself. The shell is bash, not busybox sh: Debian's static busybox runs its
own applets ahead of PATH, so `grep` in a command would have been busybox
grep rather than the image's.

Installed content-addressed (<data>/platform/<hash16>/), so a running
sandbox keeps the version it started with while new ones get the new one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

from corral.errors import Unavailable

MOUNT_POINT = "/.corral"
SHELL = f"{MOUNT_POINT}/bin/bash"
BUSYBOX = f"{MOUNT_POINT}/bin/busybox"
INIT = f"{MOUNT_POINT}/bin/corral-init"
WATCH = f"{MOUNT_POINT}/bin/corral-watch"
BUSYBOX_CANDIDATES = (Path("/bin/busybox"), Path("/usr/bin/busybox"))
BASH_CANDIDATES = (Path("/bin/bash-static"), Path("/usr/bin/bash-static"))
PT_INTERP = 3


def is_static_elf(path: Path) -> bool:
    """True for an ELF64 executable without a program interpreter."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:
            return False
        (phoff,) = struct.unpack_from("<Q", head, 32)
        phentsize, phnum = struct.unpack_from("<HH", head, 54)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    return all(struct.unpack_from("<I", table, i * phentsize)[0] != PT_INTERP for i in range(phnum))


@dataclass(frozen=True)
class Platform:
    layer_dir: Path  # bind-mounted read-only at /.corral
    nsexec: Path  # host-side helper that runs crun in a private mount namespace
    seccompd: Path  # host-side daemon answering and counting refused syscalls
    relisten: Path  # host-side helper: a restored sandbox's seccomp listeners back
    netmove: Path  # host-side helper: a copy's connections to the outside aborted
    run: Path  # host-side: Corral's own runtime (oci_runtime = "corral")
    # Empty, root's, read-only: what masked directories are bound to (it is
    # also /.corral/empty in every sandbox).
    empty_dir: Path

    def cgroup_skeleton(self, hierarchies: list[Path]) -> Path:
        """/.corral/cgroup: read-only, an empty directory for each cgroup v1
        hierarchy (named as on the host, with the host's symlinks to them,
        such as cpu -> cpu,cpuacct). A container's /sys/fs/cgroup is a bind
        of it, and its own cgroup of each hierarchy is bound on that
        hierarchy's directory (bundle.cgroup_mounts): crun's way, a tmpfs
        to hold the mount points, is a superblock per sandbox, which costs
        every memory cgroup on the host a shrinker slot (bundle.masks).
        Inside the layer, so a checkpoint carries it as a bind of /.corral."""
        root = self.layer_dir / "cgroup"
        names = {h.name for h in hierarchies}
        dirs = [*(root / n for n in sorted(names)), root]  # the root made read-only last
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        for link in sorted(p for p in hierarchies[0].parent.iterdir() if p.is_symlink()):
            target = os.readlink(link)
            if target in names:
                with contextlib.suppress(FileExistsError):  # another agent made it
                    os.symlink(target, root / link.name)
        for d in dirs:
            os.chmod(d, 0o555)  # whatever the umask
        return root


def install(src_bin: Path, dest_root: Path) -> Platform:
    """Copy the helpers into a content-addressed platform layer (idempotent)."""
    init, nsexec = src_bin / "corral-init", src_bin / "corral-nsexec"
    seccompd, relisten = src_bin / "corral-seccompd", src_bin / "corral-relisten"
    watch, run = src_bin / "corral-watch", src_bin / "corral-run"
    netmove = src_bin / "corral-netmove"
    for helper in (init, nsexec, seccompd, relisten, watch, run, netmove):
        if not helper.is_file():
            raise Unavailable(
                f"{helper} is missing: build the platform helpers with `make -C native` "
                "(the install script does it)"
            )
    busybox = next((p for p in BUSYBOX_CANDIDATES if p.is_file()), None)
    if busybox is None or not is_static_elf(busybox):
        raise Unavailable(
            "a static busybox is needed for the platform shell: apt-get install busybox-static"
        )
    bash = next((p for p in BASH_CANDIDATES if p.is_file()), None)
    if bash is None or not is_static_elf(bash):
        raise Unavailable(
            "a static bash is needed for the platform shell: apt-get install bash-static"
        )
    files = {"corral-init": init, "corral-watch": watch, "busybox": busybox, "bash": bash}
    h = hashlib.sha256()
    for name, path in sorted(files.items()):
        h.update(name.encode() + b"\0" + path.read_bytes())
    dest = dest_root / h.hexdigest()[:16]
    if not (dest / ".complete").exists():
        tmp = dest_root / f".tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "bin").mkdir(parents=True)
        for name, path in files.items():
            shutil.copyfile(path, tmp / "bin" / name)
            os.chmod(tmp / "bin" / name, 0o555)
        os.symlink("busybox", tmp / "bin" / "sh")
        (tmp / ".complete").touch()
        try:
            os.rename(tmp, dest)
        except OSError:  # another process installed the same version first
            shutil.rmtree(tmp, ignore_errors=True)
    # Inside the layer: a checkpoint carries the masks as binds of the
    # platform mount it already carries (runtimes/container/criu.py).
    empty = dest / "empty"
    empty.mkdir(mode=0o555, exist_ok=True)
    if any(empty.iterdir()):  # it must hide, not show: never trust what is there
        raise Unavailable(f"{empty} must be empty (masked directories are bound to it)")
    os.chmod(empty, 0o555)
    return Platform(
        layer_dir=dest,
        nsexec=nsexec,
        seccompd=seccompd,
        relisten=relisten,
        netmove=netmove,
        run=run,
        empty_dir=empty,
    )
