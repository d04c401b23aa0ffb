"""Housekeeping of a node: TTLs, idle timeouts, dead sandboxes, leftovers.

Several agents may share a node (one per process on a data dir). Exactly one
of them, the leader, holds an exclusive flock on <data>/leader.lock and does
the housekeeping; the kernel drops the lock when its process dies, however
it dies, and another agent takes over at its next tick.

Recovery (on becoming leader) and gc (every GC_EVERY seconds, and
`corral gc`) rest on one invariant: every resource was recorded before it was
made (node/store.py). So a sandbox whose owner process died mid-create is
unwound from its resource rows, and anything on disk or in the kernel named
after a sandbox id that has no active record is a leftover to reclaim.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from corral import metrics
from corral.api.models import VM_KINDS
from corral.errors import CorralError
from corral.execd.client import ExecdClient
from corral.log import get_logger
from corral.node.store import ACTIVE_STATES, SandboxRecord
from corral.runtimes.base import process_start_time
from corral.runtimes.container.runtime import control_path
from corral.runtimes.fncall.pool import POOL_LABEL

if TYPE_CHECKING:
    from corral.node.agent import NodeAgent

log = get_logger("corral.maintenance")

GC_EVERY = 60.0
PURGE_AFTER = 3600.0


@dataclass
class GcReport:
    reattached: int = 0
    reclaimed_sandboxes: int = 0
    reclaimed: dict[str, int] = field(default_factory=dict)
    layers_released: int = 0

    def count(self, kind: str) -> None:
        self.reclaimed[kind] = self.reclaimed.get(kind, 0) + 1
        metrics.RECLAIMED.labels(kind).inc()

    def add(self, other: GcReport) -> None:
        self.reattached += other.reattached
        self.reclaimed_sandboxes += other.reclaimed_sandboxes
        self.layers_released += other.layers_released
        for kind, n in other.reclaimed.items():
            self.reclaimed[kind] = self.reclaimed.get(kind, 0) + n


def init_alive(rec: SandboxRecord) -> bool:
    return rec.init_pid is not None and process_start_time(rec.init_pid) == rec.init_start


class Maintenance:
    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent
        self.is_leader = False
        self._lock_fd: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_gc = 0.0
        self._last_liveness = 0.0
        self._silent_since: dict[str, float] = {}  # VM guests not answering, since when
        self.recovered: GcReport | None = None  # what taking the lead reclaimed

    async def start(self) -> None:
        if self._try_lead():
            self.recovered = await self.recover()
            await self.agent.start_resolver()
        self._task = asyncio.create_task(self._loop(), name="corral-maintenance")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.agent.flush_activity()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
            self.is_leader = False

    def _try_lead(self) -> bool:
        if self.is_leader:
            return True
        path = self.agent.config.data_dir / "leader.lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_fd = fd
        self.is_leader = True
        log.info("maintenance.leader", owner=self.agent.owner)
        return True

    async def _loop(self) -> None:
        interval = self.agent.config.reaper_interval
        while True:
            await asyncio.sleep(interval)
            try:
                self.agent.flush_activity()
                self.agent.reap()
                if not self.is_leader and self._try_lead():
                    self.recovered = await self.recover()
                    await self.agent.start_resolver()
                if self.is_leader:
                    await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.error("maintenance.failed", exc=True)

    async def tick(self) -> None:
        now = time.time()
        db = self.agent._db()
        check_liveness = now - self._last_liveness >= self.agent.config.liveness_interval
        if check_liveness:
            self._last_liveness = now
            await self._check_loader()
        for rec in db.list(["running"]):
            idle = rec.spec.get("idle_timeout")
            if rec.expires_at is not None and now >= rec.expires_at:
                await self.agent.retire(rec.id, reason="ttl expired")
            elif idle and now - rec.last_active >= idle:
                await self.agent.retire(rec.id, reason=f"idle for {idle:.0f}s")
            elif check_liveness and not init_alive(rec):
                await self._fail(rec, "its init process exited")
            elif check_liveness and self._orphan_worker(rec):
                await self.agent.retire(rec.id, reason="its function-call pool is gone")
        if check_liveness:
            await self._check_guests(now)
        metrics.SANDBOXES_ACTIVE.set(db.count_active()[0])
        if now - self._last_gc >= GC_EVERY:
            self._last_gc = now
            await self.gc()

    async def _check_guests(self, now: float) -> None:
        """A VM's QEMU can be alive around a dead guest: a kernel stuck with
        interrupts off, a PID 1 starved by a real-time spinner. Ping every
        running guest's agent; one silent for vm_hang_timeout has failed."""
        db = self.agent._db()
        guests = [r for r in db.list(["running"]) if r.kind in VM_KINDS and init_alive(r)]
        limit = min(self.agent.config.liveness_interval, 5.0)

        async def answers(rec: SandboxRecord) -> bool:
            client = ExecdClient(str(control_path(self.agent.config.run_dir, rec.id)))
            try:
                await asyncio.wait_for(client.ping(), limit)
                return True
            except (TimeoutError, CorralError, OSError):
                return False

        alive = await asyncio.gather(*(answers(r) for r in guests))
        for rec, ok in zip(guests, alive, strict=True):
            if ok:
                self._silent_since.pop(rec.id, None)
                continue
            since = self._silent_since.setdefault(rec.id, now)
            if now - since >= self.agent.config.vm_hang_timeout:
                self._silent_since.pop(rec.id, None)
                metrics.VM_FAILURES.labels("hung").inc()
                await self._fail(rec, f"its guest stopped answering for {now - since:.0f}s (hung)")
        running = {r.id for r in guests}
        for gone in set(self._silent_since) - running:
            del self._silent_since[gone]

    def _orphan_worker(self, rec: SandboxRecord) -> bool:
        """A pooled function-call worker lives only as long as the agent
        whose pool holds it (nobody else can hand it out)."""
        from corral.node.agent import owner_alive

        return (
            POOL_LABEL in rec.labels
            and rec.owner != self.agent.owner
            and not owner_alive(rec.owner)
        )

    async def _check_loader(self) -> None:
        """A dead lazy loader leaves every sandbox reading through it with
        EIO forever: fail them now, clear its mounts; the next create starts
        a new loader."""
        lazy = self.agent.layers.lazy
        if lazy is None or await asyncio.to_thread(lazy.alive):
            return
        db = self.agent._db()
        victims = db.list(["running"])
        log.error("lazy.dead", sandboxes=len(victims))
        metrics.LOADER_FAILURES.inc()
        for rec in victims:
            await self._fail(rec, "the node's lazy layer loader died; the sandbox lost its files")
        await asyncio.to_thread(self.agent.layers.release_all)

    async def _fail(self, rec: SandboxRecord, why: str) -> None:
        db = self.agent._db()
        console = getattr(self.agent.runtimes.get(rec.kind), "console_tail", None)
        if console is not None:
            # A VM's "init" is its emulator: the guest's console says what
            # happened inside (a panic, an OOM kill) before it went.
            why = f"{why}; the guest's last console lines:\n{console(rec.id)}"
        if db.transition(rec.id, [rec.state], "closing"):
            log.warning("sandbox.failed", sandbox=rec.id, reason=why)
            await self.agent._release(rec.id, "failed", why)

    async def recover(self) -> GcReport:
        """Re-attach to sandboxes that outlived their agent; unwind the rest."""
        report = GcReport()
        db = self.agent._db()
        from corral.node.agent import owner_alive

        for rec in db.list(ACTIVE_STATES):
            if rec.owner != self.agent.owner and rec.state != "running" and owner_alive(rec.owner):
                continue  # another live agent is creating or closing it
            if rec.state == "suspended":
                report.reattached += 1  # on disk, no process: nothing to attach to
                continue
            if rec.state == "running" and self._orphan_worker(rec):
                await self.agent.retire(rec.id, reason="its function-call pool is gone")
                report.reclaimed_sandboxes += 1
                continue
            if rec.state == "running" and init_alive(rec):
                # A VM's control path is served by its agent's channel, which
                # died with that agent: this one serves it now.
                # (Only if nobody answers there: another live agent may.)
                attach = getattr(self.agent.runtimes.get(rec.kind), "attach", None)
                control = control_path(self.agent.config.run_dir, rec.id)
                if attach is not None and not await _answers(control):
                    await attach(rec.id, control)
                report.reattached += 1
                continue
            why = {
                "creating": "its agent died while creating it",
                "closing": "its agent died while closing it",
                "running": "its init process exited",
                "suspending": "its agent died while suspending it",
                "resuming": "its agent died while resuming it",
            }[rec.state]
            if rec.state == "creating" and rec.owner == self.agent.owner:
                continue  # our own create in flight
            await self._fail(rec, why)
            report.reclaimed_sandboxes += 1
        gc = await self.gc()
        report.reclaimed = gc.reclaimed
        report.layers_released = gc.layers_released
        log.info(
            "maintenance.recovered",
            reattached=report.reattached,
            reclaimed_sandboxes=report.reclaimed_sandboxes,
            reclaimed=report.reclaimed,
        )
        return report

    async def gc(self) -> GcReport:
        """Reclaim everything named after a sandbox that has no active record."""
        report = GcReport()
        agent = self.agent
        db = agent._db()

        def is_active(sid: str) -> bool:
            # Checked after the resource was seen: records are written before
            # resources, so a resource of a create racing with us has one.
            rec = db.get(sid)
            return rec is not None and rec.state in ACTIVE_STATES

        # Resource rows of finished sandboxes: a release that failed earlier.
        for sid, kind, ref in db.all_resources():
            if is_active(sid):
                continue
            try:
                await agent.release_resource(kind, ref)
                db.drop_resource(sid, kind, ref)
                report.count(kind)
            except Exception as exc:
                log.error("gc.release_failed", sandbox=sid, kind=kind, ref=ref, error=str(exc))

        cfg = agent.config
        prefix = f"{cfg.node}-"
        found: dict[str, set[str]] = {
            "container": {
                i for r in agent.runtimes.values() for i in getattr(r, "leftovers", set)()
            },
            "subvolume": set(agent.scratch.names()),
            "dir": {p.name for p in cfg.sandboxes_dir.iterdir()},
            "socket": {p.stem for p in cfg.run_dir.glob("*.sock")},
        }
        for kind, ids in found.items():
            for sid in sorted(ids):
                if not sid.startswith(prefix) or is_active(sid):
                    continue
                if kind == "container":
                    refs = [("container", sid), ("cgroup", sid)]
                elif kind == "dir":
                    refs = [("dir", str(cfg.sandboxes_dir / sid))]
                elif kind == "socket":
                    refs = [("socket", str(cfg.run_dir / f"{sid}.sock"))]
                else:
                    refs = [(kind, sid)]
                for k, ref in refs:
                    try:
                        await agent.release_resource(k, ref)
                        report.count(k)
                    except Exception as exc:
                        log.error("gc.release_failed", sandbox=sid, kind=k, error=str(exc))
        report.layers_released = len(agent.layers.release_unused(db.referenced_layers()))
        db.purge_closed(time.time() - PURGE_AFTER)
        if report.reclaimed:
            log.info("gc.reclaimed", reclaimed=report.reclaimed)
        return report


async def _answers(control: Path) -> bool:
    from corral.execd.client import ExecdClient

    try:
        await asyncio.wait_for(ExecdClient(str(control), connect_timeout=1).ping(), 2)
    except (CorralError, OSError, TimeoutError):
        return False
    return True
