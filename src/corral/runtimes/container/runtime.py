"""Container sandboxes: an OCI bundle run by crun, corral-init as PID 1."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import secrets
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from corral.errors import Conflict, InvalidArgument, SandboxFailed
from corral.execd.client import ExecdClient
from corral.execd.protocol import VERSION as PROTO_VERSION
from corral.guard import filter as seccomp_filter
from corral.guard import seccomp
from corral.host import spawn
from corral.host.cgroups import Cgroups, IoLimit, Mode
from corral.host.platform import Platform
from corral.host.procs import process_start_time
from corral.runtimes import drawn
from corral.runtimes.base import Boot, Prepared, Releaser, RuntimeSpec, Started, Suspension
from corral.runtimes.container import bundle, criu, runplan, xscreen
from corral.runtimes.container.oci import OciRuntime, Overlay
from corral.runtimes.container.relisten import relisten
from corral.runtimes.container.xscreen import XScreen
from corral.runtimes.vm import desktop
from corral.runtimes.vnc import ByteStream, ExecStream


class ContainerRuntime:
    kind = "container"
    net_tap: str | None = None
    commands_on_host = True  # HostCommands
    readonly_root = False
    tmpfs: tuple[tuple[str, int], ...] = ()

    def __init__(
        self,
        oci: OciRuntime,
        cgroups: Cgroups,
        platform: Platform,
        seccomp_listener: Path | None,
        io: IoLimit | None = None,
        ns_limits: dict[str, int] | None = None,
        sandboxes_dir: Path | None = None,
    ) -> None:
        self.oci = oci
        # Where each sandbox's dir is (its layout, its checkpoint): with
        # it, and CRIU on the host, containers also suspend to disk.
        self.sandboxes_dir = sandboxes_dir
        if sandboxes_dir is not None and criu.available() is None:
            self.suspend_modes = ("freeze", "disk")
            self.can_snapshot = True
        self.io = io
        # /proc/sys/user limits set in each sandbox's user namespace.
        self.ns_limits = ns_limits or {}
        self.cgroups = cgroups
        self.platform = platform
        # cgroup v1: /sys/fs/cgroup from binds, not crun's tmpfs (bundle.cgroup_mounts).
        self.cgroup_skeleton = (
            None if cgroups.mode is Mode.V2 else platform.cgroup_skeleton(cgroups.hierarchies)
        )
        self.seccomp_listener = seccomp_listener
        self.swap_accounting = cgroups.mode is Mode.V2 or any(
            (h / "memory.memsw.limit_in_bytes").exists() for h in cgroups.hierarchies
        )
        # Compiled seccomp filters by seccomp.filter_key(): compiling the
        # allow-list with libseccomp costs crun ~20 ms a create (its own
        # cache is not used here), so it is handed to crun ready-made
        # (run.oci.seccomp_bpf_data), with no rules beside it to parse:
        # compiled here as a binary tree (guard/filter.py: a fifth of the
        # kernel's cost to attach it), else the BPF crun wrote for the
        # first sandbox. runc has no such annotation: it gets the rules.
        self._bpf: dict[str, str] = {}
        # corral-run reads the compiled filter from a file (written once).
        # (Written at the first start: the run tmpfs is mounted after this.)
        self._bpf_file: Path | None = None
        self._bpf_written = False
        if seccomp_listener is not None and (oci.binary.endswith("crun") or oci.own):
            compiled = seccomp_filter.sandbox_filter()
            if compiled is not None:
                self._bpf[seccomp.filter_key()] = base64.b64encode(compiled).decode()
                if oci.own:
                    # Beside the runtime's state, not in it (runfs: what is
                    # in there is a sandbox's, and keeps the tmpfs up).
                    name = f"filter-{seccomp.filter_key()[:16]}.bpf"
                    self._bpf_file = oci.state_root.parent / name
            elif oci.own:
                raise InvalidArgument(
                    "oci_runtime", "corral-run needs the seccomp filter compiled here "
                    "(libseccomp >= 2.5)", "corral")  # fmt: skip

    def resources(self, sandbox_id: str, prep: Prepared) -> list[tuple[str, str]]:
        return [("socket", str(prep.control)), ("dir", str(self.oci.bundle(sandbox_id))),
                ("container", sandbox_id), ("cgroup", sandbox_id)]  # fmt: skip

    def _new_bundle(self, sandbox_id: str) -> Path:
        """The bundle's dir, with stage/ (corral-nsexec's idmapped mounts)
        and rootfs/ (the overlay's mount point, in the container's
        namespaces only). Traversable, not listable: the container's user
        namespace root walks it to the rootfs."""
        b = self.oci.bundle(sandbox_id)
        b.mkdir(mode=0o711)
        (b / "stage").mkdir(mode=0o700)
        (b / "rootfs").mkdir()
        return b

    def _cgroup_dirs(self, sandbox_id: str) -> tuple[tuple[str, Path], ...]:
        """Each hierarchy's name and the sandbox's cgroup in it (made by
        crun before it mounts them), bound over the skeleton."""
        if self.cgroup_skeleton is None:
            return ()
        dirs = self.cgroups.dirs(sandbox_id)
        return tuple((h.name, d) for h, d in zip(self.cgroups.hierarchies, dirs, strict=True))

    async def start(self, spec: RuntimeSpec, prep: Prepared, boot: Boot) -> Started:
        if boot.net is not None:
            raise ValueError("a container's network is attached after start")
        if boot.state is not None:
            return await self._start_from(spec, prep, boot.state)
        b = self._new_bundle(spec.id)
        rootfs = b / "rootfs"
        profile, key = None, ""
        if self.seccomp_listener is not None:
            # Compiled once (see _bpf), the rules need not be written again.
            key = seccomp.filter_key()
            where = str(self.seccomp_listener)
            profile = seccomp.profile(where, spec.id, rules=key not in self._bpf)
        cfg = bundle.config(
            bundle.BundleSpec(
                sandbox_id=spec.id,
                rootfs=rootfs,
                platform_dir=self.platform.layer_dir,
                env=prep.env,
                cpu=spec.cpu,
                memory=spec.memory,
                pids=spec.pids,
                cgroups_path=self.cgroups.oci_path(spec.id),
                swap_accounting=self.swap_accounting,
                seccomp=profile,
                host_id=prep.host_id,
                readonly_root=self.readonly_root,
                tmpfs=self.tmpfs,
                io=self.io,
                swappiness=None if self.cgroups.mode is Mode.V2 else 0,
                empty_dir=self.platform.empty_dir,
                cgroup_skeleton=self.cgroup_skeleton,
                cgroup_dirs=self._cgroup_dirs(spec.id),
            )
        )
        pid_file = b / "init.pid"
        if self.oci.own:
            if self._bpf_file is not None and not self._bpf_written:
                # Whole or not at all: another agent of the node may be
                # starting a sandbox from the same file.
                tmp = self._bpf_file.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_bytes(base64.b64decode(self._bpf[key]))
                os.replace(tmp, self._bpf_file)
                self._bpf_written = True
            # crun would make the cgroups from the config; corral-run joins
            # those the agent made (as for a restore, with the same limits).
            self.cgroups.create(spec.id, cpu=spec.cpu, memory=spec.memory, pids=spec.pids,
                                period=bundle.CPU_PERIOD, io=self.io)  # fmt: skip
            data = runplan.plan(
                cfg, cgroup_dirs=self.cgroups.dirs(spec.id), pid_file=pid_file,
                bpf_file=self._bpf_file, cgroup_v2=self.cgroups.mode is Mode.V2,
            )  # fmt: skip
            (self.oci.state_root / spec.id).mkdir()  # what known() and forget() see
            config_file = b / "plan"
        else:
            if key in self._bpf:
                cfg["annotations"] = {"run.oci.seccomp_bpf_data": self._bpf[key]}
            data = json.dumps(cfg).encode()  # dumps: the C encoder (dump writes piece by piece)
            config_file = b / "config.json"
        # Its env may hold secrets; the bundle dir is only traversable.
        fd = os.open(config_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)

        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if prep.control.exists():
                prep.control.unlink()
            listener.bind(str(prep.control))
            os.chmod(prep.control, 0o600)
            listener.listen(512)
            await self.oci.run(
                spec.id,
                b,
                overlay=Overlay(prep.lower, prep.upper, prep.work, rootfs),
                idmap=(prep.host_id, bundle.IDS) if prep.host_id is not None else None,
                stage=b / "stage",
                listen_fd=listener.fileno(),
                pid_file=pid_file,
                log_file=b / "oci.log",
                ns_limits=self.ns_limits if prep.host_id is not None else None,
                plan=config_file if self.oci.own else None,
            )
        finally:
            # The container's init holds its own copy of the listening socket.
            listener.close()
        if key and key not in self._bpf:
            compiled = self.oci.state_root / spec.id / "seccomp.bpf"
            if compiled.exists():
                self._bpf[key] = base64.b64encode(compiled.read_bytes()).decode()
        # crun keeps its own copy in its state. This one (18 KB with the
        # filter inside, and the env's secrets) would only cost the run
        # tmpfs memory for as long as the sandbox lives.
        config_file.unlink()
        if self.sandboxes_dir is not None:
            criu.Layout(
                lower=[str(p) for p in prep.lower], upper=str(prep.upper), work=str(prep.work),
                rootfs=str(rootfs), control=str(prep.control),
                platform_dir=str(self.platform.layer_dir), host_id=prep.host_id,
            ).save(b / "layout.json")  # fmt: skip
        pid = int(pid_file.read_text().strip())
        started = process_start_time(pid)
        if started is None:
            # Quoted, not pointed at: the bundle goes with its release.
            said = _last_words(b / "oci.out", b / "oci.log")
            raise SandboxFailed(
                f"sandbox {spec.id}: its init (pid {pid}) exited right after start; "
                f"it and crun said: {said}",
                sandbox=spec.id,
            )
        return Started(pid=pid, pid_start=started)

    async def _limit_namespace(self, sandbox_id: str, pid: int) -> None:
        """Give a restored sandbox its own share of the per-user-namespace
        kernel counters (corral-nsexec --limits says why), before it runs
        anything. (A started one has them from corral-nsexec --limits-of.)"""
        args = [f"{k}={v}" for k, v in sorted(self.ns_limits.items())]
        try:
            done = await spawn.run(
                [str(self.platform.nsexec), "--limits", str(pid), *args],
                timeout=criu.HELPER_TIMEOUT,
            )
        except TimeoutError:
            raise SandboxFailed(
                f"sandbox {sandbox_id}: setting its kernel counter limits ran past "
                f"{criu.HELPER_TIMEOUT:g} s",
                sandbox=sandbox_id,
            ) from None
        if done.code != 0:
            raise SandboxFailed(
                f"sandbox {sandbox_id}: setting its kernel counter limits failed: "
                f"{done.stderr.decode(errors='replace').strip()}",
                sandbox=sandbox_id,
            )

    # ------------------------------------------------------------ suspend

    suspend_modes: tuple[str, ...] = ("freeze",)
    can_snapshot = False  # fork, save, restore: with CRIU
    # A command's connection to the agent cannot be checkpointed (criu.py).
    disk_needs_idle = True

    def resize(self, sandbox_id: str, cpu: float, memory: int, pids: int) -> None:
        self.cgroups.set_limits(
            sandbox_id, cpu=cpu, memory=memory, pids=pids, period=bundle.CPU_PERIOD
        )

    async def suspend(self, sandbox_id: str, mode: str) -> Suspension:
        """freeze: every process stops where it stands (the cgroup
        freezer: no signal, nothing inside can tell), then the host takes
        back its page cache and, where it has swap, its memory. disk: the
        processes are checkpointed with CRIU and end (criu.py)."""
        if mode == "disk":
            return await self._dump(sandbox_id)
        await self.cgroups.freeze(sandbox_id)
        return Suspension(reclaim=lambda: self.cgroups.reclaim(sandbox_id))

    async def resume(self, sandbox_id: str, mode: str) -> Started | None:
        if mode == "disk":
            return await self._restore(sandbox_id)
        await self.cgroups.thaw(sandbox_id)
        return None

    def _sdir(self, sandbox_id: str) -> Path:
        assert self.sandboxes_dir is not None
        return self.sandboxes_dir / sandbox_id

    async def _dump(
        self, sandbox_id: str, *, holder: Path | None = None, state: Path | None = None
    ) -> Suspension:
        """Checkpoint into `holder` (<sandbox>/checkpoint: the processes
        end); with `state`, a snapshot: packed there with the writable
        layer while the sandbox is frozen, and the processes run on."""
        d, b = self._sdir(sandbox_id), self.oci.bundle(sandbox_id)
        snapshot = state is not None
        holder = holder or d / "checkpoint"
        layout = criu.Layout.load(b / "layout.json")
        pid = int((b / "init.pid").read_text().strip())
        nonce = secrets.token_hex(8)
        await ExecdClient(layout.control).park(nonce)
        try:
            # Parked, init starts no handler; the last ones (a request just
            # answered, a park that reached a handler first) are on their
            # way out, and each holds a connection CRIU cannot dump.
            for _ in range(400):
                if not criu.handlers(pid):
                    break
                await asyncio.sleep(0.005)
            else:
                raise Conflict(
                    f"sandbox {sandbox_id} is still serving a request: try again",
                    sandbox=sandbox_id,
                )
            await self.cgroups.freeze(sandbox_id)
            size = await criu.dump(pid, holder, layout, nonce,
                                   self.cgroups.freezer_dir(sandbox_id),
                                   leave_running=snapshot, hybrid=self.oci.hybrid)  # fmt: skip
            if state is not None:
                await criu.pack(holder, Path(layout.upper), state, layout.host_id)
        except BaseException:
            # CRIU left the tree as it found it: frozen, init parked.
            await self._wake(sandbox_id, pid, nonce, layout)
            raise
        if snapshot:  # the source runs on: thawed, unparked with a new listener
            await self._wake(sandbox_id, pid, nonce, layout)
            return Suspension(state_bytes=size)
        with contextlib.suppress(OSError, TimeoutError):  # its tasks are gone
            await self.cgroups.thaw(sandbox_id)
        return Suspension(state_bytes=size)

    async def _wake(self, sandbox_id: str, pid: int, nonce: str, layout: criu.Layout) -> None:
        await self.cgroups.thaw(sandbox_id)
        listener = criu.listen(Path(layout.control))
        try:
            await asyncio.to_thread(criu.unpark, pid, nonce, listener)
        finally:
            listener.close()

    # ------------------------------------------------------------ snapshots

    async def state_version(self) -> str:
        """A checkpoint loads where CRIU and corral-init speak as here."""
        done = await spawn.run([criu.CRIU, "--version"], stdout=True, timeout=criu.HELPER_TIMEOUT)
        version = done.stdout.decode().split("\n")[0].removeprefix("Version: ").strip()
        return f"criu-{version}+init-{PROTO_VERSION}"

    async def snapshot(self, sandbox_id: str, state: Path) -> int:
        """A checkpoint of a running container, and its writable layer, in
        one file; the sandbox pauses for the dump and the copy, then runs
        on (a fork's source)."""
        d = self._sdir(sandbox_id)
        holder = d / f"snap-{secrets.token_hex(4)}"
        try:
            await self._dump(sandbox_id, holder=holder, state=state)
        finally:
            shutil.rmtree(holder, ignore_errors=True)
        return state.stat().st_size

    async def saved_state(self, sandbox_id: str) -> Path:
        d = self._sdir(sandbox_id)
        layout = criu.Layout.load(self.oci.bundle(sandbox_id) / "layout.json")
        state = d / "container.state"
        await criu.pack(d / "checkpoint", Path(layout.upper), state, layout.host_id)
        return state

    async def _start_from(self, spec: RuntimeSpec, prep: Prepared, state: Path) -> Started:
        """A new sandbox from a packed checkpoint (a fork's copy, a
        restore): its writable layer and processes, in this sandbox's own
        id block and cgroups."""
        b = self._new_bundle(spec.id)
        layout = criu.Layout(
            lower=[str(p) for p in prep.lower], upper=str(prep.upper), work=str(prep.work),
            rootfs=str(b / "rootfs"), control=str(prep.control),
            platform_dir=str(self.platform.layer_dir), host_id=prep.host_id,
        )  # fmt: skip
        holder = prep.sandbox_dir / "checkpoint"
        await criu.unpack(state, holder, prep.upper, prep.host_id)
        self.cgroups.create(spec.id, cpu=spec.cpu, memory=spec.memory, pids=spec.pids,
                            period=bundle.CPU_PERIOD, io=self.io)  # fmt: skip
        layout.save(b / "layout.json")
        pid = await criu.restore(holder, layout, self.oci.nsexec, self.oci.hybrid,
                                 cgroup_root=self.cgroups.oci_path(spec.id))  # fmt: skip
        (b / "init.pid").write_text(str(pid))
        shutil.rmtree(holder, ignore_errors=True)
        started = process_start_time(pid)
        if started is None:
            raise SandboxFailed(f"sandbox {spec.id}: its restored init exited", sandbox=spec.id)
        if prep.host_id is not None and self.ns_limits:
            await self._limit_namespace(spec.id, pid)
        await self._relisten(spec.id)
        return Started(pid=pid, pid_start=started)

    async def _relisten(self, sandbox_id: str) -> None:
        if self.seccomp_listener is not None:
            await relisten(self.platform.relisten, self.seccomp_listener, sandbox_id,
                           self.cgroups.thread_files(sandbox_id))  # fmt: skip

    async def _restore(self, sandbox_id: str) -> Started:
        d, b = self._sdir(sandbox_id), self.oci.bundle(sandbox_id)
        layout = criu.Layout.load(b / "layout.json")
        pid = await criu.restore(d / "checkpoint", layout, self.oci.nsexec, self.oci.hybrid)
        (b / "init.pid").write_text(str(pid))
        started = process_start_time(pid)
        if started is None:
            raise SandboxFailed(
                f"sandbox {sandbox_id}: its restored init exited", sandbox=sandbox_id
            )
        if layout.host_id is not None and self.ns_limits:
            await self._limit_namespace(sandbox_id, pid)  # restore resets them
        await self._relisten(sandbox_id)
        shutil.rmtree(d / "checkpoint", ignore_errors=True)
        return Started(pid=pid, pid_start=started)

    def display(self, sandbox_id: str, size: tuple[int, int], control: Path) -> XScreen:
        return XScreen(sandbox_id, control, size)

    async def wait_drawn(self, sandbox_id: str, control: Path, size: tuple[int, int]) -> None:
        """Start the image's desktop session on Xvfb, then wait until it has
        drawn (runtimes/drawn.py)."""
        client = ExecdClient(str(control))
        deadline = asyncio.get_running_loop().time() + drawn.DRAWN_TIMEOUT
        if not await drawn.has(sandbox_id, client, desktop.SESSION_PATH, deadline):
            raise InvalidArgument(
                "display_size",
                f"needs an image with a desktop session ({desktop.SESSION_PATH}), like "
                f"image={desktop.BASE!r} with toolkit=[{desktop.TOOLKIT!r}]",
                f"{size[0]}x{size[1]}",
            )
        env = [*xscreen.ENV, f"CORRAL_XVFB={size[0]}x{size[1]}"]
        await client.run(
            ["/bin/sh", "-c", f'setsid "$0" </dev/null >{drawn.SESSION_LOG} 2>&1 &',
             desktop.SESSION_PATH],
            user="root", timeout=30, env=env, cap=4096,
        )  # fmt: skip
        await drawn.wait(sandbox_id, client, self.display(sandbox_id, size, control))

    async def open_vnc(self, sandbox_id: str, control: Path, seconds: float) -> ByteStream:
        """x11vnc in the sandbox for this one view (runtimes/vnc.py)."""
        return await ExecStream.x11vnc(control, seconds)

    def close_handles(self) -> None:
        self.oci.close()  # shared by the container runtimes: closing twice is fine

    def releasers(self) -> dict[str, Releaser]:
        # The cgroup is the node's to release (host/cgroups.py), like a VM's.
        # One releaser however many container runtimes share the OCI runtime.
        return {"container": _Deleter(self.oci, self.cgroups)}

    def leftovers(self) -> dict[str, set[str]]:
        """Sandbox ids with container state in the OCI runtime's root."""
        return {"container": self.oci.known(), "dir": self.oci.bundles()}


@dataclass(frozen=True)
class _Deleter:
    oci: OciRuntime
    cgroups: Cgroups

    async def __call__(self, sandbox_id: str) -> None:
        # Every process of a container is in its cgroups (its init was put
        # there before it ran anything; inside, the cgroup file systems are
        # read-only and its own), so emptying and removing them ends it,
        # and what is left of it in the OCI runtime is its state dir.
        # `crun delete --force` did the same from a process of its own, in
        # a mount namespace of its own, per close: ~1 ms of host CPU.
        await asyncio.to_thread(self._delete, sandbox_id)

    def _delete(self, sandbox_id: str) -> None:
        self.cgroups.remove(sandbox_id)
        self.oci.forget(sandbox_id)


def _last_words(*logs: Path) -> str:
    """The last lines of each log that has any, in one line (bounded: a
    sandbox's init writes what it likes to its stdout)."""
    said = []
    for log_path in logs:
        try:
            with log_path.open("rb") as f:
                f.seek(max(0, log_path.stat().st_size - 2048))
                text = f.read().decode(errors="replace")
        except OSError:
            continue
        said += text.strip().splitlines()[-3:]
    return " | ".join(said)[-600:] or "nothing"
