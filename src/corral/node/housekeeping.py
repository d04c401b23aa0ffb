"""Housekeeping of a node: TTLs, idle timeouts, dead sandboxes, leftovers.

Several agents may share a node (one per process on a data dir). Exactly one
of them, the leader, holds an exclusive flock on <data>/leader.lock and does
the housekeeping; the kernel drops the lock when its process dies, however
it dies, and another agent takes over at its next tick (recovering first:
recovery.py).
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from collections.abc import Awaitable, Callable, Mapping

from corral import labels, metrics
from corral.api.models import VM_KINDS
from corral.config import NodeConfig
from corral.errors import CorralError
from corral.execd.client import ExecdClient
from corral.host import procs
from corral.host.cgroups import Cgroups
from corral.images.disks import is_disk
from corral.images.mounter import LOADER_STAMP, LayerMounts
from corral.log import get_logger
from corral.node.activity import Activity
from corral.node.children import Children
from corral.node.cpuclasses import CpuClasses
from corral.node.lifecycle import Lifecycle, control_path
from corral.node.recovery import GcReport, Recovery, init_alive
from corral.node.snapshots import Snapshots
from corral.node.store import SandboxRecord, Store
from corral.runtimes.base import Diagnosable, Runtime, Suspendable

log = get_logger("corral.maintenance")

GC_EVERY = 60.0
# A tick reclaims at most this many sandboxes (each a cgroup-wide reclaim,
# tens of ms): the rest wait for the next tick.
RECLAIM_PER_TICK = 64


class Housekeeping:
    def __init__(
        self,
        config: NodeConfig,
        store: Store,
        *,
        owner: str,
        lifecycle: Lifecycle,
        recovery: Recovery,
        runtimes: Mapping[str, Runtime],
        layers: LayerMounts,
        activity: Activity,
        children: Children,
        cpu: CpuClasses,
        cgroups: Cgroups,
        on_lead: Callable[[], Awaitable[None]],
        on_tick: Callable[[], None],
        snapshots: Snapshots,
    ) -> None:
        self.config = config
        self.store = store
        self.owner = owner
        self.lifecycle = lifecycle
        self.recovery = recovery
        self.runtimes = runtimes
        self.layers = layers
        self.activity = activity
        self.children = children
        self.cpu = cpu
        self.cgroups = cgroups
        self._on_lead = on_lead  # what only the leader runs (the node's DNS)
        self._on_tick = on_tick  # the leader's batched writes (the DNS refusals)
        self.snapshots = snapshots
        self.is_leader = False
        self._lock_fd: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_gc = 0.0
        self._last_liveness = 0.0
        self._silent_since: dict[str, float] = {}  # VM guests not answering, since when
        self._loader_silent_since: float | None = None  # the lazy loader's, likewise
        # The loader epoch (images/mounter.py) whose stale sandboxes were
        # failed; None: none looked at yet (a new leader looks once).
        self._loader_epoch_seen: int | None = None
        self.recovered: GcReport | None = None  # what taking the lead reclaimed

    async def start(self) -> None:
        if self._try_lead():
            await self._lead()
        self._task = asyncio.create_task(self._loop(), name="corral-maintenance")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.activity.flush()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
            self.is_leader = False

    async def _lead(self) -> None:
        self.recovered = await self.recovery.recover()
        await self._on_lead()

    def _try_lead(self) -> bool:
        if self.is_leader:
            return True
        path = self.config.data_dir / "leader.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_fd = fd
        self.is_leader = True
        log.info("maintenance.leader", owner=self.owner)
        return True

    async def _loop(self) -> None:
        interval = self.config.reaper_interval
        while True:
            await asyncio.sleep(interval)
            try:
                self.activity.flush()
                self.children.reap()
                if not self.is_leader and self._try_lead():
                    await self._lead()
                if self.is_leader:
                    self._on_tick()
                    await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.error("maintenance.failed", exc=True)

    async def tick(self) -> None:
        now = time.time()
        db = self.store
        lc = self.lifecycle
        check_liveness = now - self._last_liveness >= self.config.liveness_interval
        if check_liveness:
            self._last_liveness = now
            await self._check_loader(now)
        # Each second: what is due, as the database answers it. Nothing
        # here walks every sandbox held on the event loop (store.py).
        for sid, reason, action in db.due_to_retire(now):
            if action == "close" or not await self._suspend_expired(sid, action):
                await lc.retire(sid, reason=reason)
        # The cores follow the load; a full pass writes a file per sandbox:
        # off the loop.
        moved = await asyncio.to_thread(self.cpu.resize, now)
        if moved is not None:
            await asyncio.to_thread(self.cpu.reapply, db.running_ids(), moved)
        if check_liveness:
            await self._check_inits()
            await self._check_guests(now)
            self._bound_logs()
        if self.config.reclaim_after:
            await self._reclaim_idle(now)
        if self.config.suspend_after:
            await self._suspend_idle(now)
        metrics.SANDBOXES_ACTIVE.set(db.count_active())
        if now - self._last_gc >= GC_EVERY:
            self._last_gc = now
            await self.recovery.gc()

    async def _suspend_expired(self, sandbox_id: str, action: str) -> bool:
        """A sandbox whose TTL ended with on_expiry "suspend" or "disk":
        suspended, with no TTL until one is set again (it would end again
        at once on resume). False where it cannot be: it is closed then, as
        its TTL said (to disk needs no command running in a container: it
        is frozen instead)."""
        # Before the suspend: a TTL set while it runs (E2B's connect) stays.
        self.store.update(sandbox_id, expires_at=None)
        modes: tuple[str | None, ...] = ("disk", None) if action == "disk" else (None,)
        for mode in modes:  # None: the kind's own depth
            try:
                await self.snapshots.suspend(sandbox_id, mode)
            except CorralError as exc:
                log.info("sandbox.expiry_suspend_failed", sandbox=sandbox_id,
                         mode=mode or "default", error=exc.message)  # fmt: skip
                continue
            log.info("sandbox.expired_suspended", sandbox=sandbox_id, mode=mode or "default")
            return True
        return False

    async def _check_inits(self) -> None:
        """Every liveness_interval: a running sandbox whose init exited has
        failed; a pooled function-call worker whose agent died is retired."""
        db = self.store
        inits = db.running_inits()
        # Off the loop: a read of /proc per init, ~8 us each.
        dead = await asyncio.to_thread(
            lambda: [sid for sid, pid, start in inits if not procs.alive(pid, start)]
        )
        for sid in dead:
            # Again, on the record as it is now: it may have closed or been
            # restored with a new init while the thread read.
            full = db.get(sid)
            if full is not None and full.state == "running" and not init_alive(full):
                await self.lifecycle.fail(full, "its init process exited")
        owners: dict[str, bool] = {}
        for sid, owner in db.running_labelled(labels.POOL):
            if owner == self.owner:
                continue
            if owner not in owners:
                owners[owner] = procs.owner_alive(owner)
            if not owners[owner]:
                await self.lifecycle.retire(sid, reason="its function-call pool is gone")
        # A guest's DHCP is answered by the agent that started it; when that
        # one has died, by the leader (the guest asks again within its lease).
        networks = self.lifecycle.networks
        for sid, owner in db.running_networked_own_disks():
            if owner == self.owner or networks.serves_dhcp(sid):
                continue
            if owner not in owners:
                owners[owner] = procs.owner_alive(owner)
            if not owners[owner]:
                networks.serve_dhcp(sid)

    async def _reclaim_idle(self, now: float) -> None:
        """Memory back from sandboxes idle for reclaim_after (no command,
        on any agent: Activity flushes busy sandboxes as used each tick),
        once per idle spell (the store marks it), at most RECLAIM_PER_TICK
        a tick. They keep running: the next command faults back what it
        touches. A VM's cgroup holds its QEMU, so its whole guest memory
        goes out (the kernels here have no cold-page finder to pick within
        it: see docs/memory-reclaim.md)."""
        due = self.store.idle_unreclaimed(
            ("container", *VM_KINDS), now - self.config.reclaim_after, RECLAIM_PER_TICK
        )
        for sid, last_active in due:
            if self.activity.running(sid):
                continue
            self.store.mark_reclaimed(sid, last_active)
            freed = await asyncio.to_thread(self.cgroups.reclaim, sid)
            metrics.MEMORY_RECLAIMED.inc(freed)

    async def _suspend_idle(self, now: float) -> None:
        """The idle policy (config.suspend_after): frozen first where a kind
        can be, then to disk after suspend_to_disk_after. A sandbox running
        a command is never idle (Activity counts it as used); a pool's is
        idle by design and is claimed running."""
        cfg = self.config
        able = {k: r for k, r in self.runtimes.items() if isinstance(r, Suspendable)}
        before = now - cfg.suspend_after
        to_disk = before - cfg.suspend_to_disk_after if cfg.suspend_to_disk_after else None
        for sid, kind, state in self.store.idle_to_suspend(able, before, to_disk, labels.POOL):
            modes = able[kind].suspend_modes
            if self.activity.running(sid):
                continue
            if state == "running":
                mode = "freeze" if "freeze" in modes else modes[0]
            elif "disk" in modes:  # frozen for suspend_to_disk_after more
                mode = "disk"
            else:
                continue
            try:
                await self.snapshots.suspend(sid, mode)
            except CorralError as exc:  # raced with a request, or cannot: next tick
                log.info("sandbox.idle_suspend_skipped", sandbox=sid, error=exc.message)

    def _bound_logs(self) -> None:
        """Logs a sandbox writes outside its disk quota (a VM's console)
        stay under their cap; what was dropped is in its audit."""
        for kind, runtime in self.runtimes.items():
            if not isinstance(runtime, Diagnosable):
                continue
            # Creating too: a guest writes its console from its first
            # instruction, and a create may wait minutes on it (a VM's boot,
            # a user's own disk drawing its screen).
            for sid in self.store.ids_in(["creating", "running"], [kind]):
                dropped = runtime.bound_logs(sid)
                if dropped:
                    self.store.count(sid, "console_dropped_bytes", dropped)

    async def _check_guests(self, now: float) -> None:
        """A VM's QEMU can be alive around a dead guest: a kernel stuck with
        interrupts off, a PID 1 starved by a real-time spinner. Ping every
        running guest's agent; one silent for vm_hang_timeout has failed."""
        vms = [self.store.get(sid) for sid in self.store.running_ids(VM_KINDS)]
        guests = [
            r
            for r in vms
            if r is not None
            and r.state == "running"
            and not is_disk(r.spec["image"])
            and init_alive(r)
        ]  # a user's own disk has no agent to ping: its QEMU's life is its own
        limit = min(self.config.liveness_interval, 5.0)

        async def answers(rec: SandboxRecord) -> bool:
            client = ExecdClient(str(control_path(self.config.run_dir, rec.id)))
            try:
                async with asyncio.timeout(limit):
                    await client.ping()
                return True
            except (TimeoutError, CorralError, OSError):
                return False

        alive = await asyncio.gather(*(answers(r) for r in guests))
        for rec, ok in zip(guests, alive, strict=True):
            if ok:
                self._silent_since.pop(rec.id, None)
                continue
            since = self._silent_since.setdefault(rec.id, now)
            if now - since >= self.config.vm_hang_timeout:
                self._silent_since.pop(rec.id, None)
                metrics.VM_FAILURES.labels("hung").inc()
                await self.lifecycle.fail(
                    rec, f"its guest stopped answering for {now - since:.0f}s (hung)"
                )
        pinged = {r.id for r in guests}
        for gone in set(self._silent_since) - pinged:
            del self._silent_since[gone]

    async def _check_loader(self, now: float) -> None:
        """A dead lazy loader leaves every sandbox reading through it with
        EIO forever: fail them now, clear its mounts; the next create starts
        a new loader. One that is only silent is slow until it has been
        silent for lazy_hang_timeout: then it is hung, and killed."""
        lazy = self.layers.lazy
        if lazy is None:
            return
        health = await asyncio.to_thread(lazy.health)
        if health != "silent":
            self._loader_silent_since = None
        else:
            since = self._loader_silent_since = self._loader_silent_since or now
            if now - since < self.config.lazy_hang_timeout:
                log.warning("lazy.silent", seconds=round(now - since, 1))
                return
            self._loader_silent_since = None
            pid = await asyncio.to_thread(lazy.kill)
            log.error("lazy.hung", pid=pid, seconds=round(now - since, 1))
        if health not in ("absent", "serving") and await asyncio.to_thread(
            self.layers.clear_dead_loader
        ):
            metrics.LOADER_FAILURES.inc()
        # Not only after a clear of its own: a create that found the loader
        # dead first cleared it (under the layer lock), and the sandboxes
        # that read through it are this check's to fail all the same.
        await self._fail_stale_layers()

    async def _fail_stale_layers(self) -> None:
        """Fail the running sandboxes whose layers were mounted through a
        loader that has died since (their stamp below the node's epoch)."""
        epoch = await asyncio.to_thread(self.layers.epoch)
        if epoch == self._loader_epoch_seen or epoch == 0:  # 0: no stamp is below it
            self._loader_epoch_seen = epoch
            return
        running = self.store.list(["running"])
        stale = await asyncio.to_thread(self._stale, running, epoch)
        self._loader_epoch_seen = epoch
        if stale:
            log.error("lazy.dead", sandboxes=len(stale), epoch=epoch)
        for rec in stale:
            await self.lifecycle.fail(
                rec, "the node's lazy layer loader died; the sandbox lost its files"
            )

    def _stale(self, running: list[SandboxRecord], epoch: int) -> list[SandboxRecord]:
        stale = []
        for rec in running:
            try:
                stamp = int((self.config.sandboxes_dir / rec.id / LOADER_STAMP).read_text())
            except (FileNotFoundError, ValueError):
                continue  # not mounted through this node's layer mounts
            if stamp < epoch:
                stale.append(rec)
        return stale
