"""MicroVM sandboxes: a QEMU microvm per sandbox, the image's layers as
read-only drives, corral-init as the guest's agent on a virtio-serial port.

The node agent prepares a VM exactly as it prepares a container (record,
admission, layers ensured, a control path); this runtime turns that into a
guest: every layer's EROFS metadata image and its data blob become drives
(the blob through the node's lazy loader when it runs, so a guest too reads
only the chunks it touches), the guest's init stacks them under an overlay
with a writable upper of `disk` bytes, and the AgentChannel serves the
control path. So `sbx.commands` and `sbx.files` are the container's code.

Resources, recorded before they exist: the control socket, the VM (its
QEMU process and port socket) and its cgroup (QEMU's memory is the guest's
RAM plus the emulator's own, so the limit is `memory` + VM_OVERHEAD).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

from corral.errors import SandboxFailed
from corral.execd import protocol as p
from corral.execd.client import ExecdClient
from corral.host.cgroups import Cgroups
from corral.host.procs import process_start_time
from corral.images.disks import Disks
from corral.images.layer import Layer
from corral.images.mounter import LOADER_STAMP, LayerMounts
from corral.log import get_logger
from corral.runtimes import drawn
from corral.runtimes.base import Boot, Prepared, Releaser, RuntimeSpec, Started, Suspension
from corral.runtimes.vm import desktop, guest, owndisk
from corral.runtimes.vm.channel import AgentChannel
from corral.runtimes.vm.display import Display
from corral.runtimes.vm.owndisk import OwnDisk
from corral.runtimes.vm.qemu import NETDEV, QEMU, DiskVM, Drive, MicroVM, accelerator
from corral.runtimes.vm.qmp import Qmp
from corral.runtimes.vnc import ByteStream, SocketStream

log = get_logger("corral.vm")

# QEMU's own memory under TCG (translation cache, device state): measured
# 175-260 MiB of RSS per idle guest on these hosts (HOST-NOTES).
VM_OVERHEAD = 320 * 2**20
MIN_GUEST_MEMORY = 128 * 2**20
DEFAULT_DISPLAY = (1024, 768)
TAP = "tap0"  # in the VM's own network namespace: one name for every VM
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
PMEM_ALIGN = 128 * 2**20
CONSOLE_MAX = 1 << 20  # a guest's console log on the host, at most (then trimmed)
CONSOLE_KEEP = 256 << 10  # what is kept of it: the lines a failure report shows
# How long a copy's NIC stays unplugged (renew_link). Long enough for a
# guest's driver to see the carrier go (Linux's e1000 checks on the link
# interrupt, within its 2 s watchdog at worst); read at call time.
LINK_DOWN = 2.0
FALLOC_FL_COLLAPSE_RANGE = 0x08
# A save writes the guest's memory at disk speed (~1 s per GiB here); one
# still going after this is stuck (its `cat` blocked, the disk gone) and is
# cancelled, the guest running on, rather than holding its caller forever.
SAVE_TIMEOUT = 300.0
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def vm_capable() -> bool:
    """Whether this host can run microVMs (QEMU installed); the node then
    offers the kind and reports it in its capacity."""
    return shutil.which(QEMU) is not None


class MicroVMRuntime:
    """Runtime, Suspendable, Snapshottable, Reattachable, Diagnosable."""

    kind = "microvm"
    # The resource kind of its QEMU process: one per runtime, as each keeps
    # its own channels (and a full VM its displays) to close on release.
    resource = "vm"
    net_tap: str | None = TAP

    def __init__(
        self,
        layers: LayerMounts,
        cgroups: Cgroups,
        sandboxes_dir: Path,
        *,
        free_page_reporting: bool = True,
        tcg_cache_mib: int = 0,
        quiet_idle: bool = True,
    ) -> None:
        self.layers = layers
        self.free_page_reporting = free_page_reporting
        self.tcg_cache_mib = tcg_cache_mib
        self.quiet_idle = quiet_idle
        self.cgroups = cgroups
        self.sandboxes_dir = sandboxes_dir
        self.channels: dict[str, AgentChannel] = {}
        self._artefacts: guest.GuestArtefacts | None = None

    def artefacts(self) -> guest.GuestArtefacts:
        if self._artefacts is None:
            self._artefacts = guest.build()
        return self._artefacts

    async def state_version(self) -> str:
        return (await asyncio.to_thread(self.artefacts)).version

    def resources(self, sandbox_id: str, prep: Prepared) -> list[tuple[str, str]]:
        return [("socket", str(prep.control)), (self.resource, sandbox_id), ("cgroup", sandbox_id)]

    def releasers(self) -> dict[str, Releaser]:
        # The cgroup is the node's to release (host/cgroups.py).
        return {self.resource: self._release_vm}

    def leftovers(self) -> dict[str, set[str]]:
        """Sandboxes whose QEMU still runs (its pid file says which)."""
        pid_files = self.sandboxes_dir.glob("*/qemu.pid")
        return {self.resource: {p.parent.name for p in pid_files if _qemu(p, self.kind)}}

    def _dir(self, sandbox_id: str) -> Path:
        return self.sandboxes_dir / sandbox_id

    def _drives(self, digests: list[str], skip: int | None = None) -> list[Drive]:
        """Layer i (0 = topmost): its metadata image `l<i>m`, its data `l<i>b`;
        layer `skip` is on pmem instead."""
        drives = []
        for i, digest in enumerate(reversed(digests)):
            if i == skip:
                continue
            layer: Layer = self.layers.store.get(digest)
            drives.append(Drive(self.layers.store.blob_path(layer.meta_digest), f"l{i}m"))
            if layer.blob_size:
                data = (
                    self.layers.lazy.device(digest)
                    if self.layers.lazy is not None
                    else self.layers.store.blob_path(layer.blob_digest)
                )
            else:
                # mkfs.erofs --blobdev names a data device even for a tree
                # with no file data (a commit of config only): the guest's
                # mount wants one all the same, so it gets the empty blob.
                data = self.layers.store.blob_path(layer.blob_digest)
                if not data.exists():
                    data.parent.mkdir(parents=True, exist_ok=True)
                    data.touch()
            drives.append(Drive(data, f"l{i}b"))
        return drives

    async def start(self, spec: RuntimeSpec, prep: Prepared, boot: Boot) -> Started:
        """Boot the guest; with `boot.state`, load a saved guest instead (a
        fork or restore: the machine must be the one the state was saved
        from, and it is, as it is built from the same spec and layers)."""
        art = await asyncio.to_thread(self.artefacts)
        d = self._dir(spec.id)
        memory = max(MIN_GUEST_MEMORY, spec.memory)
        display = self.display_size(spec)
        layers = list(spec.layers)
        cmdline = f"corral.layers={len(layers)} corral.disk={spec.disk}"
        if display is not None:
            cmdline += " corral.display=1"
        pmem = await self.pmem_image(layers[0]) if layers else None
        base = len(layers) - 1  # the bottom layer's index, counted from the top
        if pmem is not None:
            cmdline += f" corral.pmem={base}"
        net = boot.net
        if net is not None:
            cmdline += f" corral.ip={net.address} corral.gw={net.gateway}"
        vm = MicroVM(
            kernel=art.kernel,
            initrd=art.initrd,
            agent_socket=d / "agent.port",
            console_log=d / "console.log",
            qmp_socket=d / "qmp.sock",
            memory_mib=memory // 2**20,
            cpus=max(1, round(spec.cpu)),
            drives=self._drives(layers, skip=base if pmem is not None else None),
            cmdline=cmdline,
            accel=accelerator(),
            display=display,
            vnc_socket=d / "vnc.sock" if display is not None else None,
            pmem=pmem,
            free_page_reporting=self.free_page_reporting,
            tap=TAP if net is not None else None,
            tb_mib=self.tcg_cache_mib,
            quiet_idle=self.quiet_idle,
        )
        if layers:
            # QEMU opens the lazy devices now: through the loader as it is
            # now (started again if the one the create's prepare found has
            # died since), and the sandbox stamped with its epoch (a stamp
            # from before had the leader fail a VM reading through the new).
            found = [self.layers.store.get(d, names=False) for d in layers]
            await asyncio.to_thread(self.layers.ensure_all, found, prep.sandbox_dir / LOADER_STAMP)
        started = await self._launch(spec.id, vm.argv(), memory, boot.state)
        await self.attach(spec.id, prep.control)
        return started

    async def _launch(
        self, sandbox_id: str, argv: list[str], memory: int, state: Path | None
    ) -> Started:
        """QEMU for `argv` in the sandbox's cgroup: booted, or loaded from `state`."""
        self.cgroups.make_dirs(sandbox_id)
        self.cgroups.set_memory(sandbox_id, memory + VM_OVERHEAD)
        # Kept for resume: a saved state loads only into the same machine.
        (self._dir(sandbox_id) / "qemu.argv").write_text(json.dumps(argv))
        if state is None:
            return self._spawn(sandbox_id, argv)
        return await self._load(sandbox_id, argv, state)

    def display_size(self, spec: RuntimeSpec) -> tuple[int, int] | None:
        return None  # a microVM has no display

    async def pmem_image(self, digest: str) -> Path | None:
        return None  # microvm cannot map virtio-pmem in QEMU 7.2 (HOST-NOTES)

    def _spawn(self, sandbox_id: str, argv: list[str]) -> Started:
        d = self._dir(sandbox_id)
        cgroup_dirs = self.cgroups.dirs(sandbox_id)
        # A VM with a NIC gets a network namespace of its own, where QEMU
        # makes its tap and the node puts the sandbox's veth beside it.
        netns = "-netdev" in argv
        with open(d / "qemu.log", "ab") as out:
            # Not asyncio's subprocess: the node agent reaps its children
            # itself (it is their subreaper), and a child watcher would race it.
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
                preexec_fn=lambda: _prepare_child(cgroup_dirs, netns),
            )
        started = process_start_time(proc.pid)
        if started is None:
            raise SandboxFailed(f"sandbox {sandbox_id}: QEMU exited at once; see {d / 'qemu.log'}")
        # With its start time: a pid alone may name another process later.
        (d / "qemu.pid").write_text(f"{proc.pid} {started} {self.kind}\n")
        return Started(pid=proc.pid, pid_start=started, process=proc)

    async def _save(self, sandbox_id: str, state: Path, *, then: str) -> int:
        """Save the paused guest's memory and devices to `state`, then
        `quit` (suspend) or `cont` (fork: the source runs on)."""
        qmp = await Qmp.connect(self._dir(sandbox_id) / "qmp.sock")
        try:
            # QEMU's default migration bandwidth (32 MiB/s) would make a
            # 256 MiB guest take seconds to save.
            await qmp.execute("migrate-set-parameters", **{"max-bandwidth": 8 << 30})
            await qmp.execute("stop")
            await qmp.execute("migrate", uri=f"exec:cat > {state}")
            loop = asyncio.get_running_loop()
            deadline = loop.time() + SAVE_TIMEOUT
            while True:
                info = await qmp.execute("query-migrate")
                status = info.get("status")
                if status == "completed":
                    break
                if status in ("failed", "cancelled") or loop.time() > deadline:
                    if status not in ("failed", "cancelled"):
                        await qmp.execute("migrate_cancel")
                        status = f"still {status} after {SAVE_TIMEOUT:g} s"
                    await qmp.execute("cont")
                    raise SandboxFailed(f"sandbox {sandbox_id}: saving its state {status}")
                await asyncio.sleep(0.02)
            # "completed" is reported before QEMU leaves finish-migrate (its
            # cleanup runs later, in the main loop), and cont is refused in
            # that state: wait for postmigrate.
            for _ in range(500):
                if await qmp.status() != "finish-migrate":
                    break
                await asyncio.sleep(0.01)
            await self._saved(sandbox_id, state, then)
            await qmp.execute(then)
        finally:
            qmp.close()
        return state.stat().st_size

    async def _saved(self, sandbox_id: str, state: Path, then: str) -> None:
        """The state is saved and the guest still paused, its drives flushed."""

    # "disk" first: a VM's default suspend ends its QEMU (what save needs).
    suspend_modes = ("disk", "freeze")

    async def suspend(self, sandbox_id: str, mode: str) -> Suspension:
        """disk: save the guest's memory and devices and end its QEMU. The
        guest does not notice: its processes and monotonic clocks carry on
        from where they were (the node sets its wall clock on resume).
        freeze: stop its vCPUs and push QEMU's memory out (swap, where the
        host has it); the same QEMU runs on at resume."""
        if mode == "freeze":
            await self._qmp(sandbox_id, "stop")
            return Suspension(reclaim=lambda: self.cgroups.reclaim(sandbox_id))
        size = await self._save(sandbox_id, self._dir(sandbox_id) / "vm.state", then="quit")
        await self._wait_gone(sandbox_id)
        return Suspension(state_bytes=size)

    async def _qmp(self, sandbox_id: str, command: str, **arguments: Any) -> None:
        qmp = await Qmp.connect(self._dir(sandbox_id) / "qmp.sock")
        try:
            await qmp.execute(command, **arguments)
        finally:
            qmp.close()

    async def saved_state(self, sandbox_id: str) -> Path:
        return self._dir(sandbox_id) / "vm.state"

    async def snapshot(self, sandbox_id: str, state: Path) -> int:
        """Save a running guest to `state` for copies to start from; the
        guest pauses while its memory is written (~0.1 s per 256 MiB)."""
        return await self._save(sandbox_id, state, then="cont")

    async def resume(self, sandbox_id: str, mode: str) -> Started | None:
        """freeze: run the vCPUs again. disk: a new QEMU, the same machine,
        loaded from the saved state."""
        if mode == "freeze":
            await self._qmp(sandbox_id, "cont")
            return None
        d = self._dir(sandbox_id)
        state = d / "vm.state"
        (d / "qmp.sock").unlink(missing_ok=True)
        (d / "agent.port").unlink(missing_ok=True)
        started = await self._load(sandbox_id, json.loads((d / "qemu.argv").read_text()), state)
        state.unlink(missing_ok=True)
        return started

    async def _load(self, sandbox_id: str, argv: list[str], state: Path) -> Started:
        """A new QEMU for `argv` with its guest loaded from `state`, running."""
        d = self._dir(sandbox_id)
        started = self._spawn(sandbox_id, [*argv, "-incoming", f"exec:cat {state}"])
        try:
            qmp = await Qmp.connect(d / "qmp.sock")
        except (OSError, SandboxFailed) as exc:
            raise self._not_loaded(sandbox_id, str(exc)) from None
        try:
            for _ in range(3000):  # polled: QMP has no "loaded" event to wait on
                status = await qmp.status()
                if status not in ("inmigrate", "prelaunch"):
                    break
                await asyncio.sleep(0.02)
            if status != "paused":
                raise self._not_loaded(sandbox_id, f"QEMU's state is {status}")
            await qmp.execute("cont")
        except OSError as exc:  # QEMU exited on a state it could not read
            raise self._not_loaded(sandbox_id, f"QEMU exited ({exc})") from None
        except SandboxFailed as exc:  # closed its socket, or stopped answering
            raise self._not_loaded(sandbox_id, str(exc)) from None
        finally:
            qmp.close()
        return started

    def _not_loaded(self, sandbox_id: str, why: str) -> SandboxFailed:
        return self._qemu_failed(sandbox_id, "its saved state did not load", why)

    def _qemu_failed(self, sandbox_id: str, what: str, why: str) -> SandboxFailed:
        """`what` went wrong, with the last lines QEMU wrote."""
        try:
            said = (self._dir(sandbox_id) / "qemu.log").read_text(errors="replace")
        except OSError:
            said = ""
        tail = " | ".join(said.strip().splitlines()[-3:])
        return SandboxFailed(
            f"sandbox {sandbox_id}: {what}: {why}" + (f"; QEMU said: {tail}" if tail else ""),
            sandbox=sandbox_id,
        )

    async def _wait_gone(self, sandbox_id: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            # The pid alone: a QEMU that already exited is a zombie to reap.
            pid = int((self._dir(sandbox_id) / "qemu.pid").read_text().split()[0])
            for _ in range(1000):
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)  # noqa: ASYNC222 (WNOHANG: never blocks)
                if process_start_time(pid) is None:
                    return
                await asyncio.sleep(0.01)

    async def attach(self, sandbox_id: str, control: Path) -> None:
        """Serve `control` for this VM (at start, and after an agent restart)."""
        port = self._dir(sandbox_id) / "agent.port"
        channel = AgentChannel(
            control,
            lambda: asyncio.open_unix_connection(str(port), limit=4 * p.MAX_PAYLOAD),
        )
        await channel.start()
        os.chmod(control, 0o600)
        self.channels[sandbox_id] = channel

    async def detach_all(self) -> None:
        """Stop serving every channel (this agent is stopping)."""
        channels, self.channels = self.channels, {}
        await asyncio.gather(*(c.aclose() for c in channels.values()))

    def bound_logs(self, sandbox_id: str) -> int:
        """Keep the guest's console log under CONSOLE_MAX (its last
        CONSOLE_KEEP bytes): the guest writes it, the host stores it, and
        no quota of the sandbox's covers it. Returns the bytes dropped."""
        path = self._dir(sandbox_id) / "console.log"
        try:
            size = path.stat().st_size
        except OSError:
            return 0
        if size <= CONSOLE_MAX:
            return 0
        return drop_head(path, size - CONSOLE_KEEP)

    def console_tail(self, sandbox_id: str, lines: int = 60) -> str:
        """The guest's last console lines (a crash, a hang, an OOM), from its
        last CONSOLE_KEEP bytes: the guest writes the file, and it may not
        have been trimmed yet (bound_logs runs on a tick)."""
        try:
            with open(self._dir(sandbox_id) / "console.log", "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - CONSOLE_KEEP))
                text = f.read(CONSOLE_KEEP).decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    async def _release_vm(self, ref: str) -> None:
        channel = self.channels.pop(ref, None)
        if channel is not None:
            await channel.aclose()
        pid = _qemu(self._dir(ref) / "qemu.pid", self.kind)
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            await self._wait_gone(ref)
        (self._dir(ref) / "agent.port").unlink(missing_ok=True)


class FullVMRuntime(MicroVMRuntime):
    """Also HasDisplay. A q35 guest with a display: the same layers, agent and channel as a
    microVM, plus a screen, a tablet and a keyboard (display.py). The
    image's /etc/corral/session, when it has one, is started by the guest's
    init (the desktop); the sandbox is ready when its desktop is drawn
    (wait_drawn), so an agent's first screenshot shows it."""

    kind = "fullvm"
    resource = "fullvm"

    def __init__(
        self,
        layers: LayerMounts,
        cgroups: Cgroups,
        sandboxes_dir: Path,
        *,
        free_page_reporting: bool = True,
        tcg_cache_mib: int = 0,
        quiet_idle: bool = True,
        pmem_dir: Path | None = None,
        disks: Disks | None = None,
    ) -> None:
        super().__init__(
            layers,
            cgroups,
            sandboxes_dir,
            free_page_reporting=free_page_reporting,
            tcg_cache_mib=tcg_cache_mib,
            quiet_idle=quiet_idle,
        )
        self.displays: dict[str, Display] = {}
        self.pmem_dir = pmem_dir  # None: every layer on virtio-blk
        self.disks = disks  # None: no user's own disks on this node
        self._pmem_locks: dict[str, asyncio.Lock] = {}

    async def pmem_image(self, digest: str) -> Path | None:
        """The base layer as one flat EROFS image, for virtio-pmem + DAX:
        every full VM on the node maps the same host pages, instead of each
        keeping its own copy in its page cache. Built once per node and
        layer from the layer's host mount (which reads it whole)."""
        if self.pmem_dir is None:
            return None
        image = self.pmem_dir / f"{digest.removeprefix('sha256:')}.erofs"
        async with self._pmem_locks.setdefault(digest, asyncio.Lock()):
            if not image.exists():
                await asyncio.to_thread(self._build_pmem_image, digest, image)
        return image

    def _build_pmem_image(self, digest: str, image: Path) -> None:
        image.parent.mkdir(parents=True, exist_ok=True)
        tmp = image.with_suffix(".tmp")
        # Tail data inline in metadata blocks cannot be mapped with DAX.
        proc = subprocess.run(
            ["mkfs.erofs", "-Enoinline_data", "--quiet", str(tmp), str(self.layers.path(digest))],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise SandboxFailed(f"building the pmem image of {digest} failed: {proc.stderr[-500:]}")
        # A pmem device is a multiple of 128 MiB (memory hotplug's section).
        size = tmp.stat().st_size
        os.truncate(tmp, -(-size // PMEM_ALIGN) * PMEM_ALIGN)
        os.replace(tmp, image)
        log.info("vm.pmem_image", layer=digest, bytes=size)

    def display_size(self, spec: RuntimeSpec) -> tuple[int, int] | None:
        w, h = spec.display_size or DEFAULT_DISPLAY
        return int(w), int(h)

    async def start(self, spec: RuntimeSpec, prep: Prepared, boot: Boot) -> Started:
        if spec.disk_image is None:
            return await super().start(spec, prep, boot)
        return await self._start_own_disk(spec, prep, boot)

    async def _start_own_disk(self, spec: RuntimeSpec, prep: Prepared, boot: Boot) -> Started:
        """Boot the user's disk through its firmware (runtimes/vm/owndisk.py):
        no Corral kernel, no agent, no channel to serve."""
        if self.disks is None or spec.disk_image is None:
            raise SandboxFailed(f"sandbox {spec.id}: this node offers no disks")
        d = self._dir(spec.id)
        disk = await asyncio.to_thread(self.disks.get, spec.disk_image)
        own = OwnDisk(
            # In the scratch subvolume: its quota bounds what the guest writes.
            overlay=prep.upper.parent / owndisk.OVERLAY,
            vars=d / owndisk.VARS if spec.firmware == "uefi" else None,
        )
        await asyncio.to_thread(owndisk.prepare, disk, own, boot.state)
        own.save(d)
        display = self.display_size(spec)
        assert display is not None
        memory = max(MIN_GUEST_MEMORY, spec.memory)
        vm = DiskVM(
            overlay=own.overlay,
            console_log=d / "console.log",
            qmp_socket=d / "qmp.sock",
            vnc_socket=d / "vnc.sock",
            display=display,
            memory_mib=memory // 2**20,
            cpus=max(1, round(spec.cpu)),
            vars=own.vars,
            accel=accelerator(),
            tb_mib=self.tcg_cache_mib,
            tap=TAP if boot.net is not None else None,
        )
        started = await self._launch(spec.id, vm.argv(), memory, boot.state)
        if vm.tap is not None and boot.state is None:
            # The node bridges the tap as soon as this returns (no agent to
            # wait for), and QEMU makes it during its start: its control
            # socket greets only once the machine, NIC backends included, is up.
            try:
                (await Qmp.connect(d / "qmp.sock")).close()
            except (OSError, SandboxFailed) as exc:
                raise self._qemu_failed(spec.id, "its machine did not start", str(exc)) from None
        return started

    async def _saved(self, sandbox_id: str, state: Path, then: str) -> None:
        own = OwnDisk.of(self._dir(sandbox_id))
        if own is not None and then == "cont":
            # A fork's copies need the disk as it is at this moment, too.
            await asyncio.to_thread(owndisk.keep_for_copies, own, state)

    async def wait_drawn(self, sandbox_id: str, control: Path, size: tuple[int, int]) -> None:
        """Until the image's desktop session has drawn (runtimes/drawn.py).
        An image without a session has no desktop to wait for: its screen
        is the console, ready with the agent. A user's own disk has no
        agent: its screen must show something and hold still."""
        if OwnDisk.of(self._dir(sandbox_id)) is not None:
            screen = self.display(sandbox_id, size)
            await drawn.wait_still(sandbox_id, screen, owndisk.QUIET, owndisk.DRAWN_TIMEOUT)
            return
        client = ExecdClient(str(control))
        deadline = asyncio.get_running_loop().time() + drawn.DRAWN_TIMEOUT
        if await drawn.has(sandbox_id, client, desktop.SESSION_PATH, deadline):
            await drawn.wait(sandbox_id, client, self.display(sandbox_id, size, control))

    async def open_vnc(self, sandbox_id: str, control: Path, seconds: float) -> ByteStream:
        return await SocketStream.connect(self.vnc_socket(sandbox_id))

    def vnc_socket(self, sandbox_id: str) -> Path:
        """The sandbox's screen over VNC (QEMU's server, no auth: root only)."""
        return self._dir(sandbox_id) / "vnc.sock"

    def display(
        self, sandbox_id: str, size: tuple[int, int], control: Path | None = None
    ) -> Display:
        d = self._dir(sandbox_id)
        found = self.displays.get(sandbox_id)
        if found is None:
            found = self.displays[sandbox_id] = Display(d / "qmp.sock", d / "screen.png", size)
        return found

    async def _save(self, sandbox_id: str, state: Path, *, then: str) -> int:
        display = self.displays.get(sandbox_id)
        if display is None:
            return await super()._save(sandbox_id, state, then=then)
        async with display.lock:  # QEMU serves one QMP client at a time
            return await super()._save(sandbox_id, state, then=then)

    async def _qmp(self, sandbox_id: str, command: str, **arguments: Any) -> None:
        display = self.displays.get(sandbox_id)
        if display is None:
            return await super()._qmp(sandbox_id, command, **arguments)
        async with display.lock:
            return await super()._qmp(sandbox_id, command, **arguments)

    async def renew_link(self, sandbox_id: str) -> None:
        """Unplug the guest's NIC for LINK_DOWN, then plug it back. A copy
        of a user's own disk wakes up holding its source's DHCP lease;
        every OS's DHCP client asks again when its link comes back (a
        REQUEST for the old address, which the node's server refuses with
        a NAK, then a DISCOVER), so the copy gets its own address the way a
        laptop moved to another network does. Set on the tap's netdev:
        QEMU passes the state to its peer, the NIC, which tells the guest."""
        await self._qmp(sandbox_id, "set_link", name=NETDEV, up=False)
        await asyncio.sleep(LINK_DOWN)
        await self._qmp(sandbox_id, "set_link", name=NETDEV, up=True)
        log.info("vm.link_renewed", sandbox=sandbox_id, down_s=LINK_DOWN)

    async def _release_vm(self, ref: str) -> None:
        self.displays.pop(ref, None)
        await super()._release_vm(ref)


def drop_head(path: Path, n: int) -> int:
    """Remove (about) the first `n` bytes of a file another process appends
    to (O_APPEND: it writes on at the new end). Collapsing the range keeps
    the rest in place where the file system can (ext4, xfs); elsewhere the
    tail is copied down. Returns the bytes removed."""
    fd = os.open(path, os.O_RDWR)
    try:
        block = os.fstatvfs(fd).f_bsize
        whole = n // block * block
        if whole and _libc.fallocate(fd, FALLOC_FL_COLLAPSE_RANGE, 0, ctypes.c_long(whole)) == 0:
            return whole
        tail = os.pread(fd, CONSOLE_KEEP, n)
        os.ftruncate(fd, 0)
        os.pwrite(fd, tail, 0)
        return n
    finally:
        os.close(fd)


def _qemu(pid_file: Path, kind: str) -> int | None:
    """The pid of the QEMU of `kind` that `pid_file` names, if that very
    process runs."""
    try:
        pid, start, of = pid_file.read_text().split()
    except (OSError, ValueError):
        return None
    return int(pid) if of == kind and str(process_start_time(int(pid))) == start else None


def _prepare_child(dirs: list[Path], netns: bool) -> None:
    """In the child, before exec: QEMU starts inside the sandbox's cgroup
    (and, for a VM with a NIC, in a new network namespace)."""
    if netns and _libc.unshare(CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET) failed")
    pid = str(os.getpid())
    for d in dirs:
        procs = d / "cgroup.procs"
        with contextlib.suppress(OSError):
            procs.write_text(pid)
