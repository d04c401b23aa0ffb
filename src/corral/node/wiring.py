"""Start-up: the node's parts, made in dependency order and handed what
each needs explicitly (no part holds the agent). Built when an agent
starts, because most parts need the open store; undone in reverse by
`NodeParts.close`.

    store, activity, children
      records -- admission -- ledger (node releasers + each runtime's)
        networks, audit
          lifecycle (create pipeline, release) <- sessions.end
            snapshots (awake, suspend/resume, fork, save/restore)
              sessions, files, displays, commits, fncall
            recovery -> housekeeping (leader lock, ticks, gc)
"""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from corral.config import NodeConfig
from corral.db import SqliteDatabase
from corral.errors import InvalidArgument, Unavailable
from corral.execd.client import ExecdClient
from corral.guard.network import NodeNetwork
from corral.guard.seccompd import SeccompDaemon
from corral.host import cgroups as cg
from corral.host import devices, runfs, swap
from corral.host import platform as plat
from corral.host.procs import host_memory
from corral.host.scratch import Scratch
from corral.images.disks import Disks, is_disk
from corral.images.mounter import LayerMounts
from corral.log import get_logger
from corral.node import ledger as ledgers
from corral.node.activity import Activity
from corral.node.admission import ID_BASE, Admission
from corral.node.audit import Audit
from corral.node.children import Children
from corral.node.commit import Commits
from corral.node.cpuclasses import CpuClasses
from corral.node.display import Displays
from corral.node.events import EventBus
from corral.node.files import Files
from corral.node.fncall.service import FnCalls
from corral.node.housekeeping import Housekeeping
from corral.node.keyed import KeyedExecs
from corral.node.ledger import Ledger
from corral.node.lifecycle import Lifecycle, control_path
from corral.node.misbehaviour import Misbehaviour
from corral.node.network import SandboxNetworks
from corral.node.records import Records
from corral.node.recovery import Recovery
from corral.node.reseed import reseed_copies
from corral.node.sandboxdirs import SandboxDirs
from corral.node.sessions import Sessions
from corral.node.snapshots import Snapshots
from corral.node.steplog import StepLog
from corral.node.store import Store
from corral.node.templates import Templates
from corral.node.tothend import ToTheEnd
from corral.node.warmpool import WarmPool
from corral.runtimes.base import HoldsHandles, Reattachable, Releaser, Runtime
from corral.runtimes.container.oci import OciRuntime
from corral.runtimes.container.runtime import ContainerRuntime
from corral.runtimes.fncall.runtime import FnCallRuntime
from corral.runtimes.vm.runtime import FullVMRuntime, MicroVMRuntime, vm_capable

log = get_logger("corral.node")


@dataclass
class NodeParts:
    config: NodeConfig
    store: Store
    cgroups: cg.Cgroups
    seccompd: SeccompDaemon
    runtimes: dict[str, Runtime]
    records: Records
    admission: Admission
    ledger: Ledger
    networks: SandboxNetworks
    audit: Audit
    events: EventBus
    activity: Activity
    cpu: CpuClasses
    children: Children
    lifecycle: Lifecycle
    snapshots: Snapshots
    sessions: Sessions
    keyed: KeyedExecs
    steplog: StepLog
    files: Files
    displays: Displays
    commits: Commits
    fncall: FnCalls
    warm: WarmPool
    recovery: Recovery
    housekeeping: Housekeeping

    async def close(self, layers: LayerMounts, network: NodeNetwork, scratch: Scratch) -> int:
        """Stop every part; the sandboxes run on. Returns how many remain
        active on the node."""
        was_leader = self.housekeeping.is_leader
        await self.warm.aclose()
        await self.fncall.pool.aclose()
        await self.housekeeping.stop()
        self.networks.stop_resolver()
        await self.keyed.aclose()
        await self.snapshots.aclose()
        await self.lifecycle.changes.aclose()
        await self.steplog.db.aclose()
        self.sessions.close_all()
        for runtime in self.runtimes.values():
            if isinstance(runtime, Reattachable):
                # The VMs run on; the next agent re-attaches their channels.
                await runtime.detach_all()
            if isinstance(runtime, HoldsHandles):
                runtime.close_handles()
        db = self.store
        active = db.count_active()

        def last_out() -> None:
            """The last agent of the node, with no sandbox left, takes down
            what the node's sandboxes shared. Under the pool's lock: an
            agent starting meanwhile waits, then finds none of it (it would
            otherwise see the seccomp daemon still running, with its socket
            gone with the run tmpfs, or lose it to our stop once started)."""
            if active == 0:
                swap.disable(self.config.data_dir / "swap")
                self.cgroups.remove_parent()
                self.seccompd.stop()
                network.remove_base()
                runfs.unmount(self.config.run_dir)

        if scratch.close(active, last_out) or was_leader:
            # The last agent of the node (or its leader) leaves no mount that
            # no sandbox needs.
            layers.release_unused(db.referenced_layers)
        db.close()
        return active


def private_tree(cfg: NodeConfig) -> None:
    """No other host user may list the node's tree or reach what is in it:
    the data dir can only be traversed (a sandbox's user namespace root,
    an unprivileged host id, walks it to its own rootfs), and what holds
    layers, chunks, scratch space and audit counters is root's alone."""
    cfg.data_dir.chmod(0o711)
    cfg.sandboxes_dir.chmod(0o711)
    for d in ("m", "lazy", "cache", "audit", "pmem"):
        path = cfg.data_dir / d
        path.mkdir(exist_ok=True)
        path.chmod(0o700)


def raise_host_limits(cfg: NodeConfig) -> None:
    """The host-wide accounts every sandbox's per-namespace share is also
    charged to (the host root's, who made each namespace): raised, never
    lowered, to hold max_sandboxes full shares and the host's own use."""
    for name, share in (("inotify/max_user_instances", cfg.inotify_instances),
                        ("inotify/max_user_watches", cfg.inotify_watches),
                        ("aio-max-nr", 2 * cfg.aio_events)):  # fmt: skip
        path = Path("/proc/sys/fs") / name
        try:
            current = int(path.read_text())
            wanted = min((cfg.max_sandboxes + 8) * share, (1 << 31) - 1)
            if current < wanted:
                path.write_text(str(wanted))
        except (OSError, ValueError) as exc:
            log.warning("host.limit_not_raised", limit=name, error=str(exc))


def raise_open_files() -> None:
    """The agent's soft RLIMIT_NOFILE up to its hard one: each command
    in flight holds a connection to its sandbox, and a login shell's
    1,024 is a few hundred busy sandboxes. What it starts inherits it (the
    seccomp daemon raises its own in any case)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard != resource.RLIM_INFINITY:  # an infinite hard limit is past fs.nr_open
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def check_node_name(cfg: NodeConfig) -> None:
    """Sandbox ids, cgroups and leftovers are named after the node: one
    data dir belongs to one node name for good."""
    name_file = cfg.data_dir / "node"
    if not name_file.exists():
        name_file.write_text(cfg.node)
    if (recorded := name_file.read_text().strip()) != cfg.node:
        raise InvalidArgument(
            "node",
            f"must be {recorded!r}, the node this data dir ({cfg.data_dir}) belongs to "
            f"(CORRAL_NODE={recorded}, or NodeConfig(node={recorded!r}))",
            cfg.node,
        )


def _runtimes(
    cfg: NodeConfig, cgroups: cg.Cgroups, platform: plat.Platform, seccompd: SeccompDaemon,
    layers: LayerMounts, scratch: Scratch,
) -> dict[str, Runtime]:  # fmt: skip
    if cgroups.unified is not None:
        cgroups.unified.mkdir(exist_ok=True)
    oci = OciRuntime(
        str(platform.run)
        if cfg.oci_runtime == "corral"
        else shutil.which(cfg.oci_runtime) or cfg.oci_runtime,
        cfg.crun_root,
        cfg.bundles_dir,
        platform.nsexec,
        hybrid=cgroups.mode is cg.Mode.HYBRID,
        unified=cgroups.unified,
    )
    listener = seccompd.socket if cfg.seccomp else None
    device = scratch.device()
    io = (
        cg.IoLimit(*device, read_bps=cfg.disk_read_bps, write_bps=cfg.disk_write_bps)
        if device is not None and (cfg.disk_read_bps or cfg.disk_write_bps)
        else None
    )
    shares = {"max_inotify_instances": cfg.inotify_instances,
              "max_inotify_watches": cfg.inotify_watches}  # fmt: skip
    limits = {k: v for k, v in shares.items() if v}  # 0: not set (the host account is shared)
    raise_host_limits(cfg)
    devices.repair(ID_BASE)
    swapping = cfg.swap_size and swap.ensure(cfg.data_dir / "swap", cfg.swap_size)  # per start
    if swapping and cfg.zswap:
        swap.enable_zswap()
    runtimes: dict[str, Runtime] = {
        "container": ContainerRuntime(
            oci, cgroups, platform, listener, io, limits, sandboxes_dir=cfg.sandboxes_dir
        ),
        "fncall": FnCallRuntime(oci, cgroups, platform, listener, cfg.fncall_tmpfs, limits),
    }
    if vm_capable():
        if cfg.vm_ksm:
            swap.enable_ksm()
        fpr = cfg.vm_free_page_reporting
        tb = cfg.vm_tcg_cache_mib
        quiet = cfg.vm_quiet_idle
        runtimes["microvm"] = MicroVMRuntime(
            layers,
            cgroups,
            cfg.sandboxes_dir,
            free_page_reporting=fpr,
            tcg_cache_mib=tb,
            quiet_idle=quiet,
        )
        runtimes["fullvm"] = FullVMRuntime(
            layers, cgroups, cfg.sandboxes_dir, free_page_reporting=fpr, tcg_cache_mib=tb,
            quiet_idle=quiet,
            pmem_dir=cfg.data_dir / "pmem" if cfg.vm_pmem else None,
            disks=Disks(cfg.disks_dir),
        )  # fmt: skip
    return runtimes


async def start_parts(
    cfg: NodeConfig,
    *,
    owner: str,
    reap_children: bool,
    layers: LayerMounts,
    network: NodeNetwork,
    scratch: Scratch,
) -> NodeParts:
    for d in (cfg.data_dir, cfg.sandboxes_dir, cfg.run_dir, cfg.platform_dir):
        d.mkdir(parents=True, exist_ok=True)
    private_tree(cfg)
    check_node_name(cfg)
    raise_open_files()
    platform = plat.install(cfg.platform_src / "bin", cfg.platform_dir)
    cgroups = cg.Cgroups(cfg.cgroup_parent, unified=cfg.unified_dir)
    if cgroups.unified is not None:
        await cg.sweep_beneath_cgroup2(platform.nsexec, cgroups.parent)
    seccompd = SeccompDaemon(cfg.data_dir, platform.seccompd, cfg.aio_events)
    with ExitStack() as undo:  # what a start that fails made, unmade; kept if it succeeds
        # The run tmpfs first: the seccomp daemon's socket is in it.
        await asyncio.to_thread(scratch.open, lambda: runfs.mount(cfg.run_dir, cfg.max_sandboxes))
        started = False
        undo.callback(lambda: _unstart(scratch, seccompd if started else None, cfg.run_dir))
        started = await asyncio.to_thread(seccompd.ensure)
        runtimes = _runtimes(cfg, cgroups, platform, seccompd, layers, scratch)
        store = Store(cfg.db_path)
        undo.callback(store.close)
        parts = await _wire(
            cfg, store, owner=owner, reap_children=reap_children, layers=layers,
            network=network, scratch=scratch, platform=platform, cgroups=cgroups,
            seccompd=seccompd, runtimes=runtimes,
        )  # fmt: skip
        await parts.housekeeping.start()
        undo.pop_all()
    return parts


def _listeners(
    cfg: NodeConfig, seccompd: SeccompDaemon, runtimes: dict[str, Runtime]
) -> tuple[int, frozenset[str]] | None:
    """How many sandboxes of which kinds the seccomp daemon can hold a
    listener for: its capacity less the function-call workers' (their
    sandboxes hold one each, outside admission)."""
    if not cfg.seccomp:
        return None
    capacity = seccompd.listener_capacity()
    kinds = frozenset(
        k for k, r in runtimes.items()
        if isinstance(r, ContainerRuntime) and not isinstance(r, FnCallRuntime)
    )  # fmt: skip
    if capacity is None or not kinds:
        return None
    return max(0, capacity - cfg.fncall_workers), kinds


def _unstart(scratch: Scratch, seccompd: SeccompDaemon | None, run_dir: Path) -> None:
    """Undo a failed start: give back the pool and, unless another agent
    holds it (its sandboxes need them), stop the daemon it started and
    unmount the run tmpfs (not while sandboxes run from it). Under the
    pool's lock, as in NodeParts.close."""

    def last_out() -> None:
        if seccompd is not None:
            seccompd.stop()
        runfs.unmount(run_dir)

    if scratch.held:
        scratch.close(0, last_out)


async def _wire(
    cfg: NodeConfig,
    store: Store,
    *,
    owner: str,
    reap_children: bool,
    layers: LayerMounts,
    network: NodeNetwork,
    scratch: Scratch,
    platform: plat.Platform,
    cgroups: cg.Cgroups,
    seccompd: SeccompDaemon,
    runtimes: dict[str, Runtime],
) -> NodeParts:

    # Suspends, resumes and forks' saves in flight (node/tothend.py): a
    # request refused by a server a save parked waits for the save.
    moves = ToTheEnd()

    def execd(sandbox_id: str) -> ExecdClient:
        rec = store.get(sandbox_id)
        if rec is not None and is_disk(rec.spec["image"]):
            raise InvalidArgument(
                "image",
                "a sandbox booted from its own disk has no Corral agent inside: commands, "
                "files and the display's windows, apps and launch need one; its screen, "
                "keyboard and pointer (sbx.display) work",
                rec.spec["image"],
            )
        return ExecdClient(
            str(control_path(cfg.run_dir, sandbox_id)), settle=lambda: settle(sandbox_id)
        )

    async def settle(sandbox_id: str) -> bool:
        """A refused or parked request's wait: for the change in flight,
        then, where it suspended the sandbox, for its resume, as before
        any request (Snapshots.awake). Whether there was a change."""
        if not await moves.wait(sandbox_id):
            return False
        await snapshots.awake(sandbox_id)
        return True

    activity = Activity(store)
    cpu = CpuClasses(
        cgroups, cfg.run_dir, enabled=cfg.cpu_classes,
        interactive_cores=cfg.cpu_interactive_cores,
        confine_interactive=cfg.cpu_confine_interactive,
    )  # fmt: skip
    children = Children(reap_children)
    records = Records(store, cfg.node, network, activity)
    admission = Admission(
        cfg, store, host_memory(), network.capacity, listeners=_listeners(cfg, seccompd, runtimes)
    )
    networks = SandboxNetworks(cfg, store, network, execd, platform.netmove)
    dirs = SandboxDirs(cfg.sandboxes_dir, cfg.spare_dirs)
    ledger = Ledger(store, ledgers.combine(
        _node_releasers(store, cgroups, scratch, networks, dirs),
        *(r.releasers() for r in runtimes.values()),
    ))  # fmt: skip
    events = EventBus(lambda sid: r.labels if (r := store.get(sid)) is not None else {})
    misbehaviour = Misbehaviour(
        cfg, store, cgroups, scratch, events,
        lambda rec: [layers.path(d) for d in reversed(rec.layers)],
    )  # fmt: skip
    audit = Audit(
        cfg, store, cgroups, seccompd, network, scratch, networks.pending, misbehaviour, events,
        activity.running,
    )  # fmt: skip

    def on_transition(sandbox_id: str, state: str) -> None:
        audit.log_state(sandbox_id, state)  # the timeline (kept while the sandbox is)
        events.publish("state", sandbox_id, state=state)

    store.on_transition = on_transition
    # Sessions end when their sandbox is released: made first, handed over.
    sessions = Sessions(cfg, store, records, activity, audit, execd, cpu, runtimes)
    lifecycle = Lifecycle(
        cfg, store, owner=owner, records=records, admission=admission, ledger=ledger,
        runtimes=runtimes, layers=layers, scratch=scratch, dirs=dirs, networks=networks,
        audit=audit, activity=activity, children=children, cpu=cpu, end_sessions=sessions.end,
        moves=moves,
        templates=Templates(cfg.data_dir / "templates", cfg.vm_templates, {
            "pmem": cfg.vm_pmem, "reporting": cfg.vm_free_page_reporting,
            "tcg_cache": cfg.vm_tcg_cache_mib,
        }),
        after_load=lambda info: reseed_copies(cfg.run_dir, [info]),
    )  # fmt: skip
    snapshots = Snapshots(
        cfg, store, records=records, lifecycle=lifecycle, runtimes=runtimes, layers=layers,
        networks=networks, children=children, activity=activity,
    )  # fmt: skip
    recovery = Recovery(
        cfg, store, owner=owner, lifecycle=lifecycle, ledger=ledger, runtimes=runtimes,
        cgroups=cgroups, scratch=scratch, layers=layers,
    )  # fmt: skip
    parts = NodeParts(
        config=cfg, store=store, cgroups=cgroups, seccompd=seccompd, runtimes=runtimes,
        records=records, admission=admission, ledger=ledger, networks=networks, audit=audit,
        events=events, activity=activity, cpu=cpu, children=children, lifecycle=lifecycle,
        snapshots=snapshots, sessions=sessions,
        keyed=KeyedExecs(store, sessions.exec),
        steplog=StepLog(SqliteDatabase(f"sqlite://{store.path}", inline=True)),
        files=Files(cfg, snapshots.awake, execd, sessions),
        displays=Displays(
            snapshots.awake, runtimes, activity, sessions.exec,
            lambda sid: control_path(cfg.run_dir, sid), node=cfg.node,
            view_key=cfg.data_dir / "view.key",
        ),
        commits=Commits(cfg, store, layers.store, scratch, admission, platform.nsexec),
        fncall=FnCalls(cfg, layers.store, cgroups, create=lifecycle.create,
                       retire=lifecycle.retire, execd=execd),
        warm=WarmPool(cfg, lifecycle),
        recovery=recovery,
        housekeeping=Housekeeping(
            cfg, store, owner=owner, lifecycle=lifecycle, recovery=recovery, runtimes=runtimes,
            layers=layers,
            activity=activity, children=children, cpu=cpu, cgroups=cgroups,
            on_lead=networks.start_resolver,
            on_tick=networks.flush_resolver, snapshots=snapshots,
        ),
    )  # fmt: skip
    return parts


def _node_releasers(
    store: Store,
    cgroups: cg.Cgroups,
    scratch: Scratch,
    networks: SandboxNetworks,
    dirs: SandboxDirs,
) -> dict[str, Releaser]:
    """The resource kinds the node itself makes for every sandbox."""

    async def subvolume(ref: str) -> None:
        await asyncio.to_thread(scratch.destroy, ref)

    async def directory(ref: str) -> None:
        await asyncio.to_thread(dirs.remove, ref)

    async def socket(ref: str) -> None:
        Path(ref).unlink(missing_ok=True)

    async def net(ref: str) -> None:
        await asyncio.to_thread(networks.disconnect, ref)

    async def idmap(ref: str) -> None:
        store.idmap_free(ref)

    async def cgroup(ref: str) -> None:
        # Off the loop: it waits for the last tasks to go (sleeps of 10 ms).
        await asyncio.to_thread(cgroups.remove, ref)

    return {"subvolume": subvolume, "dir": directory, "socket": socket, "net": net,
            "idmap": idmap, "cgroup": cgroup}  # fmt: skip


def require_root() -> None:
    if os.geteuid() != 0:
        raise Unavailable(
            "the node agent needs root (mount(2), cgroups and namespaces need "
            "CAP_SYS_ADMIN); run as root or use a remote server: AsyncClient('http://...')"
        )
