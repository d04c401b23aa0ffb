"""QEMU command lines for Corral's guests, and the accelerator choice.

KVM is used where /dev/kvm exists *and* a probe guest actually boots under
it: on these hosts /dev/kvm is PVM-based nested virtualisation on which a
stock Debian kernel hangs right after the setup code, so presence alone
proves nothing (../shared/HOST-NOTES.md). Otherwise TCG.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from corral.errors import Unavailable

QEMU = "qemu-system-x86_64"
NETDEV = "n0"  # the guest NIC's backend id
# Under TCG the TSC calibration races the emulated clock: microvm hangs in
# about one boot of ten without these (HOST-NOTES).
TCG_CMDLINE = "tsc_early_khz=2000000 no_timer_check tsc=reliable"
# An idle guest's timers are host CPU (each a TCG exit and a turn of QEMU's
# main loop), and most sandboxes idle: no soft-lockup watchdog (a timer
# every 4 s), no pressure averaging (every 2 s while anything ran), the
# per-CPU statistics folded once a minute instead of every second, no
# proactive compaction (kcompactd's twice-a-second look). Under TCG,
# tsc=reliable (always) also drops the clocksource watchdog's twice-a-
# second check of a TSC QEMU derives from the host's clock.
# docs/memory-reclaim.md.
IDLE_CMDLINE = "nowatchdog psi=0 sysctl.vm.stat_interval=60 sysctl.vm.compaction_proactiveness=0"


# Debian's OVMF (apt install ovmf): the code read-only and shared, a copy of
# the variables store per sandbox (the firmware writes its boot entries).
OVMF_CODE = Path("/usr/share/OVMF/OVMF_CODE_4M.fd")
OVMF_VARS = Path("/usr/share/OVMF/OVMF_VARS_4M.fd")
# QEMU's own seccomp filter: a guest that breaks out into the emulator finds
# no obsolete syscalls, no setuid/setgid and no scheduler or resource
# control. Spawning stays: migration to and from a file (suspend, fork,
# save) runs `cat` (QEMU 7.2 has no file: migration).
SECCOMP = "on,obsolete=deny,elevateprivileges=deny,spawn=allow,resourcecontrol=deny"


def qemu_binary() -> str:
    path = shutil.which(QEMU)
    if path is None:
        raise Unavailable(f"{QEMU} is not installed (apt install qemu-system-x86)")
    return path


def accelerator() -> str:
    """'kvm' where it is usable, else 'tcg'. KVM must be opted into with
    CORRAL_VM_ACCEL=kvm until a probe boot proves it (see the module doc)."""
    wanted = os.environ.get("CORRAL_VM_ACCEL", "tcg")
    if wanted == "kvm" and os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "kvm"
    return "tcg"


@dataclass
class Drive:
    path: Path
    serial: str  # how the guest finds it (/sys/block/vd*/serial)
    readonly: bool = True


@dataclass
class MicroVM:
    """A guest's QEMU command line. `display` makes it a full VM: q35 (PCI,
    a std VGA the guest drives with its bochs DRM driver, an absolute
    pointer and a keyboard QMP can type on); otherwise a microvm, which has
    no PCI, firmware or display and boots faster."""

    kernel: Path
    initrd: Path
    agent_socket: Path
    console_log: Path
    qmp_socket: Path
    memory_mib: int = 256
    cpus: int = 1
    drives: list[Drive] = field(default_factory=list)
    cmdline: str = ""
    accel: str = "tcg"
    display: tuple[int, int] | None = None  # (width, height): a full VM
    vnc_socket: Path | None = None  # a full VM's screen over VNC (the live view)
    # A flat EROFS image mapped into the guest by virtio-pmem (q35 only:
    # microvm in QEMU 7.2 maps it at address 0 and the guest fails).
    pmem: Path | None = None
    # The guest hands pages it frees back to the host (virtio-balloon).
    free_page_reporting: bool = True
    # A NIC on a tap of this name, which QEMU makes in its own network
    # namespace; the node bridges it to the sandbox's veth there.
    tap: str | None = None
    # TCG's translated-code cache, MiB (QEMU's own default is 1 GiB, which
    # it fills with every boot's one-off code and never gives back).
    tb_mib: int = 0
    # The guest kernel's periodic work off and, under TCG, no PIT
    # (IDLE_CMDLINE; NodeConfig.vm_quiet_idle).
    quiet_idle: bool = True

    def argv(self) -> list[str]:
        quiet = IDLE_CMDLINE if self.quiet_idle else ""
        append = " ".join(f"console=ttyS0 panic=-1 quiet {quiet} {self.cmdline}".split())
        memory = f"{self.memory_mib}M"
        if self.pmem is not None:
            if self.display is None:
                raise ValueError("virtio-pmem needs the q35 machine (a full VM)")
            # A bounce buffer would copy every DAX page (+68 MiB per VM).
            append += " swiotlb=noforce"
            size = self.pmem.stat().st_size
            memory += f",slots=2,maxmem={self.memory_mib + size // 2**20 + 128}M"
        if self.accel == "tcg":
            append += f" {TCG_CMDLINE}"
        reporting = "on" if self.free_page_reporting else "off"
        accel = self.accel
        if accel == "tcg" and self.tb_mib:
            accel += f",tb-size={self.tb_mib}"
        # microvm's virtio devices sit on MMIO ("-device"), q35's on PCI.
        bus = "device" if self.display is None else "pci"
        # No PIT on a microvm: QEMU resets it counting in square-wave mode
        # and, with no firmware to stop it and a guest that times with its
        # LAPIC, it fires 36 times a second for nothing. With the guest
        # kernel's periodic work (IDLE_CMDLINE) it made an idle VM cost
        # 0.5-0.6% of a host core under TCG; 0.1% without both
        # (bench/results/vmidle.md). The guest is told its TSC's rate
        # (TCG_CMDLINE), so it calibrates nothing against the PIT.
        # KVM (not usable on these hosts) keeps its in-kernel one: untried.
        pit = ",pit=off" if self.accel == "tcg" and self.quiet_idle else ""
        machine = f"microvm,x-option-roms=off,rtc=on{pit}" if self.display is None else "q35"
        argv = [
            qemu_binary(),
            "-M", machine,
            "-accel", accel,
            "-cpu", "max" if self.accel == "tcg" else "host",
            "-m", memory,
            "-smp", str(self.cpus),
            "-nodefaults", "-no-user-config", "-no-reboot",
            "-sandbox", SECCOMP,
            "-display", "none",
            "-kernel", str(self.kernel),
            "-initrd", str(self.initrd),
            "-append", append,
            # O_APPEND: the node trims the log from its start (capped) while
            # QEMU writes on at its end.
            "-chardev", f"file,id=console,path={self.console_log},append=on",
            "-serial", "chardev:console",
            "-qmp", f"unix:{self.qmp_socket},server=on,wait=off",
            "-device", f"virtio-serial-{bus}",
            "-chardev", f"socket,id=agent,path={self.agent_socket},server=on,wait=off",
            "-device", "virtserialport,chardev=agent,name=corral.agent",
            "-device", f"virtio-balloon-{bus},free-page-reporting={reporting}",
        ]  # fmt: skip
        if self.display is not None:
            w, h = self.display
            argv += [
                # The EDID's preferred mode is what the guest's X picks.
                "-device", f"VGA,edid=on,xres={w},yres={h}",
                "-device", "virtio-tablet-pci",
                "-device", "virtio-keyboard-pci",
            ]  # fmt: skip
            if self.vnc_socket is not None:
                argv += vnc_args(self.vnc_socket)
        if self.tap is not None:
            argv += [
                "-netdev", tap_netdev(self.tap),
                "-device", f"virtio-net-{bus},netdev={NETDEV}",
            ]  # fmt: skip
        if self.pmem is not None:
            argv += [
                "-object",
                f"memory-backend-file,id=pm0,mem-path={self.pmem},size={self.pmem.stat().st_size},"
                "share=on,readonly=on",
                "-device", "virtio-pmem-pci,memdev=pm0",
            ]  # fmt: skip
        for i, d in enumerate(self.drives):
            ro = "on" if d.readonly else "off"
            argv += [
                "-drive", f"file={d.path},if=none,id=d{i},format=raw,readonly={ro}",
                "-device", f"virtio-blk-{bus},drive=d{i},serial={d.serial}",
            ]  # fmt: skip
        return argv


def tap_netdev(tap: str) -> str:
    """The guest's NIC's backend: the tap QEMU makes in its own network
    namespace, which the node bridges to the sandbox's veth."""
    return f"tap,id={NETDEV},ifname={tap},script=no,downscript=no"


def vnc_args(socket: Path) -> list[str]:
    """Root-only socket in the sandbox's dir, no VNC auth: the node's live
    view (api/liveview.py) is the only client and checks the viewer's
    token; force-shared lets viewers coexist without one disconnecting
    the others."""
    return ["-vnc", f"unix:{socket},share=force-shared"]


@dataclass
class DiskVM:
    """A full VM that boots a user's own disk through its firmware, with
    no Corral kernel or agent: only devices every OS has drivers for (an
    AHCI disk, a std VGA, a PS/2 keyboard, a USB tablet), driven through
    the display alone. `overlay` is the sandbox's qcow2 over the user's
    read-only disk; `vars` the UEFI variables store (None: BIOS)."""

    overlay: Path
    console_log: Path
    qmp_socket: Path
    vnc_socket: Path
    display: tuple[int, int]
    memory_mib: int = 2048
    cpus: int = 1
    vars: Path | None = None
    accel: str = "tcg"
    tb_mib: int = 0
    tap: str | None = None  # a NIC (an Intel e1000, which every OS drives) on this tap

    def argv(self) -> list[str]:
        accel = self.accel
        if accel == "tcg" and self.tb_mib:
            accel += f",tb-size={self.tb_mib}"
        w, h = self.display
        argv = [
            qemu_binary(),
            "-M", "q35",
            "-accel", accel,
            "-cpu", "max" if self.accel == "tcg" else "host",
            "-m", f"{self.memory_mib}M",
            "-smp", str(self.cpus),
            "-nodefaults", "-no-user-config", "-no-reboot",
            "-sandbox", SECCOMP,
            "-display", "none",
            "-chardev", f"file,id=console,path={self.console_log},append=on",
            "-serial", "chardev:console",
            "-qmp", f"unix:{self.qmp_socket},server=on,wait=off",
            # The EDID's preferred mode is what UEFI's GOP and most OSes pick.
            "-device", f"VGA,edid=on,xres={w},yres={h}",
            "-device", "qemu-xhci",
            "-device", "usb-tablet",
            # The format is given, never probed: a raw disk whose first
            # bytes look like a qcow2 header must not become one.
            "-drive", f"file={self.overlay},if=none,id=disk0,format=qcow2",
            "-device", "ide-hd,drive=disk0,bus=ide.0,bootindex=0",
            *vnc_args(self.vnc_socket),
        ]  # fmt: skip
        if self.tap is not None:
            # Its option ROM (Debian's ipxe-qemu) gives the firmware, and a
            # boot loader through it, the network too. OVMF starts drivers
            # only for devices in QEMU's boot order, so the NIC is in it,
            # after the disk.
            argv += [
                "-netdev", tap_netdev(self.tap),
                "-device", f"e1000,netdev={NETDEV},bootindex=1",
            ]  # fmt: skip
        if self.vars is not None:
            argv += [
                "-drive", f"if=pflash,format=raw,unit=0,readonly=on,file={OVMF_CODE}",
                "-drive", f"if=pflash,format=raw,unit=1,file={self.vars}",
            ]  # fmt: skip
        return argv
