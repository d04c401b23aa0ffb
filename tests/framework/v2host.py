"""A pure cgroup v2 host, for the tests: a QEMU guest on Debian's 6.12 kernel
(built without cgroup v1 memory, as distributions now ship it) whose root is
this host's own file system, read-only over virtio-9p under a tmpfs overlay,
with one cgroup2 hierarchy at /sys/fs/cgroup and every controller enabled.

This host is hybrid (v1 controllers, an empty cgroup2 at
/sys/fs/cgroup/unified) and its cgroup mounts are not ours to change
(../shared/HOST-NOTES.md), so Corral's v2 paths (host/cgroups.py Mode.V2,
corral-run, CRIU, the freezer, memory.reclaim) run for real only in here. The
guest runs the same checkout, virtual environment and layer store as the
host: what runs in it is what `make test` runs, on another cgroup layout.

run() boots the guest, runs one shell command in it as root, and returns its
exit status and output. The command's working directory is this checkout;
/v2out is a writable directory shared with the caller (its results).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.runtimes.vm import guest, qemu

REPO = Path(__file__).resolve().parents[2]
# The guest's nodes: a container's exec server under emulation took more
# than NodeConfig's 30 s to answer once, in CI (its first create on a node).
GUEST_ENV = "CORRAL_READY_TIMEOUT=120"
OUT = REPO / "build" / "v2host"
KERNEL_PACKAGE = "linux-image-6.12-amd64"  # bookworm's newest: pure v2, EROFS from files
# Loaded in this order (their dependencies first): the guest's root, then
# what a Corral node uses (image layers, scratch space, networking).
MODULES = [
    "virtio_pci",
    "crc32c_generic",
    "virtio_blk",
    "ext4",
    "9pnet_virtio",
    "9p",
    "overlay",
    "erofs",
    "loop",
    "btrfs",
    "veth",
    "tun",
    "bridge",
    # CRIU asks the kernel for each socket's state (sock_diag).
    "unix_diag",
    "inet_diag",
    "tcp_diag",
    "udp_diag",
    "netlink_diag",
    "af_packet_diag",
    "raw_diag",
    # and for its connections' tracking state (an nfnetlink subsystem
    # missing answers EINVAL).
    "nf_conntrack_netlink",
]
# Every nftables expression and the conntrack/NAT helpers they use.
NETFILTER_DIRS = ["net/netfilter", "net/ipv4/netfilter", "net/ipv6/netfilter"]
NETFILTER = re.compile(
    r"^(nf_tables|nft_.*|nf_conntrack|nf_nat|nf_defrag_ipv[46]|nf_reject_ipv[46])$"
)

INIT = (
    "#!/bin/busybox sh\n"
    + guest.BOOT
    + """fail() { echo "v2host: $*"; poweroff -f; }
mkdir -p /host /rw /newroot
mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000 host /host \
  || fail "no host root"
mount -t tmpfs -o size=75% rw /rw
mkdir -p /rw/upper /rw/work
mount -t overlay -o lowerdir=/host,upperdir=/rw/upper,workdir=/rw/work overlay /newroot \
  || fail "no overlay"
# The layer store straight from 9p: EROFS mounts its files, and a file
# seen through overlayfs cannot back a mount ("Block device required").
[ -d /host/var/lib/corral/images ] && mount --bind /host/var/lib/corral/images /newroot/var/lib/corral/images
mount --move /dev /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777 shm /newroot/dev/shm
mount -t proc proc /newroot/proc
mount -t sysfs sys /newroot/sys
mount -t cgroup2 -o nsdelegate cgroup2 /newroot/sys/fs/cgroup || fail "no cgroup2"
for c in $(cat /newroot/sys/fs/cgroup/cgroup.controllers); do
  echo "+$c" > /newroot/sys/fs/cgroup/cgroup.subtree_control
done
# /tmp, where the tests' nodes live, on a disk as on a host (CRIU dumps a
# tmpfs's contents, and resolves binds from one differently).
mount -t ext4 /newroot/dev/vda /newroot/tmp || fail "no disk for /tmp"
chmod 1777 /newroot/tmp
for d in run var/tmp; do mount -t tmpfs -o mode=1777 tmp /newroot/$d; done
mkdir -p /newroot/v2out
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 out /newroot/v2out || fail "no out"
# A checkout under one of those (a CI's fresh clone in /tmp) is hidden by
# them: shown again, writable, over the host's.
repo=$(cat /newroot/v2out/cwd)
case "$repo" in
  /tmp/*|/run/*|/var/tmp/*)
    mkdir -p "/newroot$repo" /newroot/tmp/.v2repo/up /newroot/tmp/.v2repo/work
    mount -t overlay -o "lowerdir=/host$repo,upperdir=/newroot/tmp/.v2repo/up,workdir=/newroot/tmp/.v2repo/work" \
      overlay "/newroot$repo" || fail "no checkout at $repo" ;;
esac
ip link set lo up
hostname v2host
echo "v2host: up after $(cut -d" " -f1 /proc/uptime) s, cgroup2 controllers: $(cat /newroot/sys/fs/cgroup/cgroup.subtree_control)"
# A real root, not a chroot: a chrooted process may not make a user namespace.
cat > /newroot/run/v2stage <<'STAGE'
cd "$(cat /v2out/cwd)"
# The static keys the command would flip, turned on with one vCPU running
# and held on (tests/framework/v2keys.py says why).
echo 0 > /sys/devices/system/cpu/cpu1/online
python3 tests/framework/v2keys.py > /run/v2keys 2>&1 &
for _ in $(seq 1 600); do grep -q held /run/v2keys && break; sleep 0.1; done
grep -q held /run/v2keys || { echo "v2host: keys not held:"; cat /run/v2keys; }
echo 1 > /sys/devices/system/cpu/cpu1/online
/bin/sh /v2out/cmd.sh > /v2out/output 2>&1 < /dev/null &
# PID 1 is this shell: it reaps what the command leaves to it while it waits.
wait $!
echo $? > /v2out/rc
sync
/bin/busybox poweroff -f
STAGE
exec switch_root /newroot /bin/sh /run/v2stage
"""
)


@dataclass(frozen=True)
class Result:
    rc: int
    output: str
    boot_s: float
    wall_s: float


def kernel_package() -> str:
    deps = subprocess.run(
        ["apt-cache", "depends", KERNEL_PACKAGE], capture_output=True, text=True, check=True
    ).stdout
    m = re.search(r"Depends: (linux-image-\S+-amd64)", deps)
    if m is None:
        raise RuntimeError(f"apt knows no {KERNEL_PACKAGE} (Debian bookworm's sources?)")
    return m.group(1)


def build() -> tuple[Path, Path]:
    """(vmlinux, initrd) of the v2 host, built once per kernel package and init."""
    package = kernel_package()
    busybox = Path("/bin/busybox")
    h = hashlib.sha256()
    for part in (package, INIT, " ".join(MODULES), NETFILTER.pattern):
        h.update(part.encode() + b"\0")
    h.update(hashlib.sha256(busybox.read_bytes()).digest())
    target = OUT / h.hexdigest()[:16]
    if (target / "ready").exists():
        return target / "vmlinux", target / "initrd.cpio"
    debs = OUT / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    deb = next(iter(sorted(debs.glob(f"{package}_*.deb"))), None)
    if deb is None:
        subprocess.run(["apt-get", "download", package], cwd=debs, check=True, capture_output=True)
        deb = next(iter(sorted(debs.glob(f"{package}_*.deb"))))
    with tempfile.TemporaryDirectory(prefix="corral-v2host-") as tmp:
        work = Path(tmp)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "k")], check=True)
        release = package.removeprefix("linux-image-")
        kernel_dir = work / "k" / "lib" / "modules" / release / "kernel"
        netfilter = sorted(
            f.name.split(".ko")[0].replace("-", "_")
            for d in NETFILTER_DIRS
            for f in (kernel_dir / d).glob("*.ko*")
            if NETFILTER.match(f.name.split(".ko")[0].replace("-", "_"))
        )
        mods = guest.module_closure(kernel_dir, [*MODULES, *netfilter])
        entries: list[tuple[str, int, bytes]] = [
            (d, 0o040755, b"") for d in ("bin", "dev", "etc", "proc", "sys", "lib", "lib/modules")
        ]
        entries += [
            ("bin/busybox", 0o100755, busybox.read_bytes()),
            ("init", 0o100755, INIT.encode()),
        ]
        names = []
        for m in mods:
            name = m.name.split(".ko")[0]
            names.append(name)
            entries.append((f"lib/modules/{name}.ko", 0o100644, guest.decompressed(m)))
        entries.append(("etc/modules.order", 0o100644, ("\n".join(names) + "\n").encode()))
        staging = OUT / f".{target.name}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        bz = next((work / "k" / "boot").glob("vmlinuz-*"))
        (staging / "vmlinux").write_bytes(guest.extract_vmlinux(bz.read_bytes()))
        (staging / "initrd.cpio").write_bytes(guest.cpio_newc(entries))
        (staging / "ready").write_text(package + "\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)
        for old in OUT.iterdir():  # earlier inputs' builds
            if old.name not in (target.name, "debs", "last") and not old.name.startswith("."):
                shutil.rmtree(old, ignore_errors=True)
    return target / "vmlinux", target / "initrd.cpio"


class GuestPanicked(RuntimeError):
    """The guest's kernel panicked. Seen about once in three runs under
    multi-threaded TCG before v2keys.py: each time one byte into an
    instruction the kernel patches when a static key flips (an int3 at
    __schedule+0x407, a NOP in __alloc_pages), QEMU's vCPU threads racing
    the patch; with one TCG thread no vCPU runs while another writes. The
    guest now holds those keys on before the command runs."""


def run(
    command: str,
    timeout: float,
    memory_mib: int = 8192,
    cpus: int = 2,
    disk_gib: int = 32,
    keep: Path | None = None,
    tcg_thread: str = "multi",
) -> Result:
    """Boot the v2 host, run `command` (sh) in this checkout as root, power off.
    With `keep`, /v2out is that directory (the output grows there as the
    command writes it; a report the command writes there stays).
    `tcg_thread` (without KVM): "multi", a host thread per vCPU, or
    "single", the vCPUs taking turns on one (about half as fast)."""
    vmlinux, initrd = build()
    accel = (
        ["-accel", "kvm", "-cpu", "host"]
        if qemu.accelerator() == "kvm"
        else ["-accel", f"tcg,thread={tcg_thread}", "-cpu", "max"]
    )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="corral-v2out-") as out_dir:
        out = keep or Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "rc").unlink(missing_ok=True)
        (out / "cmd.sh").write_text(command + "\n")
        (out / "cwd").write_text(str(REPO) + "\n")
        disk = Path(out_dir) / "tmp.ext4"  # sparse: holds what the guest's /tmp does
        with open(disk, "wb") as f:
            f.truncate(disk_gib << 30)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(disk)], check=True)
        argv = [
            "qemu-system-x86_64",
            *("-machine", "q35", *accel),
            *("-m", str(memory_mib), "-smp", str(cpus), "-nographic", "-no-reboot"),
            *("-kernel", str(vmlinux), "-initrd", str(initrd)),
            *("-drive", f"file={disk},if=virtio,format=raw,cache=unsafe"),
            *("-append", "console=ttyS0 panic=-1 tsc_early_khz=2000000 no_timer_check quiet"),
            *("-virtfs", "local,path=/,mount_tag=host,security_model=passthrough,readonly=on,multidevs=remap"),
            *("-virtfs", f"local,path={out},mount_tag=out,security_model=passthrough"),
        ]  # fmt: skip
        try:
            console = subprocess.run(
                argv, capture_output=True, text=True, errors="replace", timeout=timeout
            ).stdout
        except subprocess.TimeoutExpired as e:
            raise TimeoutError(f"the v2 host ran past {timeout:.0f} s") from e
        wall = time.monotonic() - started
        if "Kernel panic" in console:
            raise GuestPanicked(f"the v2 host's kernel panicked; its console:\n{console[-4000:]}")
        boot = re.search(r"v2host: up after ([0-9.]+) s", console)
        if boot is None or not (out / "rc").exists() or not (out / "output").exists():
            raise RuntimeError(
                f"the v2 host did not run the command; its console:\n{console[-4000:]}"
            )
        return Result(
            rc=int((out / "rc").read_text().strip()),
            output=(out / "output").read_text(errors="replace"),
            boot_s=float(boot.group(1)),
            wall_s=wall,
        )


def run_past_a_panic(command: str, timeout: float, single_timeout: float, **kw: Any) -> Result:
    """run(); after a panic, once more with the vCPUs on one TCG thread
    (GuestPanicked says why) within `single_timeout`. A second panic is
    raised, with its console."""
    try:
        return run(command, timeout=timeout, **kw)
    except GuestPanicked as panic:
        print(f"v2host: the guest panicked, running again on one TCG thread: {str(panic)[-1500:]}",
              flush=True)  # fmt: skip
        return run(command, timeout=single_timeout, tcg_thread="single", **kw)


# What `make v2-host` runs: the suites whose outcome the cgroup layout can
# change (docs/cgroups.md has the table of the last run).
WIDE = [
    "tests/redteam",
    "tests/integration/test_limits.py",
    "tests/integration/test_cpu_classes.py",
    "tests/integration/test_own_runtime.py",
    "tests/integration/test_sandboxes.py",
    "tests/integration/test_commands.py",
    "tests/integration/test_suspend.py",
    "tests/integration/test_checkpoints.py",
    "tests/integration/test_warm_pool.py",
    "tests/integration/test_admission.py",
    "tests/integration/test_superblocks.py",
    "tests/integration/test_userns.py",
    "tests/integration/test_platform_integrity.py",
    "tests/integration/test_lifetimes.py",
    "tests/integration/test_recovery.py",
]


def main(argv: list[str]) -> int:
    """`python -m tests.framework.v2host [pytest args]`: the given tests (or
    WIDE) in the guest; the output grows in build/v2host/last/output."""
    import shlex

    keep = OUT / "last"
    shutil.rmtree(keep, ignore_errors=True)
    tests = argv or WIDE
    command = (
        # Containers: a VM in the guest is TCG in TCG, minutes a step.
        f"{GUEST_ENV} .venv/bin/pytest -q -p no:cacheprovider "
        "-m '(integration or redteam) and not requires_qemu' -rfEs "
        f"--junitxml=/v2out/junit.xml {' '.join(shlex.quote(t) for t in tests)}"
    )
    print(f"v2host: running in the guest, output in {keep}/output", flush=True)
    r = run_past_a_panic(command, timeout=4 * 3600, single_timeout=6 * 3600, keep=keep)
    print(r.output[-6000:])
    print(f"v2host: exit {r.rc}, booted in {r.boot_s:.1f} s, {r.wall_s:.0f} s in all")
    return r.rc


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
