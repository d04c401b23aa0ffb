"""Recovery (when an agent becomes a node's leader) and gc (every GC_EVERY
seconds, and `corral gc`).

Both rest on one invariant: every resource was recorded before it was made
(node/store.py). So a sandbox whose owner process died mid-create is
unwound from its resource rows, and anything on disk or in the kernel named
after a sandbox id that has no active record is a leftover to reclaim.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from corral import labels, metrics
from corral.config import NodeConfig
from corral.errors import CorralError
from corral.execd.client import ExecdClient
from corral.host import procs
from corral.host.cgroups import Cgroups
from corral.host.scratch import Scratch
from corral.images.disks import is_disk
from corral.images.mounter import LayerMounts
from corral.log import get_logger
from corral.node.ledger import Ledger
from corral.node.lifecycle import Lifecycle, control_path
from corral.node.store import ACTIVE_STATES, SandboxRecord, Store
from corral.runtimes.base import Reattachable, Runtime

log = get_logger("corral.maintenance")

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
    return procs.alive(rec.init_pid, rec.init_start)


def orphan_worker(rec: SandboxRecord, owner: str) -> bool:
    """A pooled function-call worker lives only as long as the agent whose
    pool holds it (nobody else can hand it out)."""
    return labels.POOL in rec.labels and rec.owner != owner and not procs.owner_alive(rec.owner)


async def answers(control: Path) -> bool:
    """Whether an exec server answers at `control` (within 2 s)."""
    try:
        async with asyncio.timeout(2):
            await ExecdClient(str(control), connect_timeout=1).ping()
    except (CorralError, OSError, TimeoutError):
        return False
    return True


_WHY = {
    "creating": "its agent died while creating it",
    "closing": "its agent died while closing it",
    "running": "its init process exited",
    "suspending": "its agent died while suspending it",
    "resuming": "its agent died while resuming it",
}


class Recovery:
    def __init__(
        self,
        config: NodeConfig,
        store: Store,
        *,
        owner: str,
        lifecycle: Lifecycle,
        ledger: Ledger,
        runtimes: Mapping[str, Runtime],
        cgroups: Cgroups,
        scratch: Scratch,
        layers: LayerMounts,
    ) -> None:
        self.config = config
        self.store = store
        self.owner = owner
        self.lifecycle = lifecycle
        self.ledger = ledger
        self.runtimes = runtimes
        self.cgroups = cgroups
        self.scratch = scratch
        self.layers = layers

    async def recover(self) -> GcReport:
        """Re-attach to sandboxes that outlived their agent; unwind the rest."""
        report = GcReport()
        for rec in self.store.list(ACTIVE_STATES):
            if rec.owner != self.owner and rec.state != "running" and procs.owner_alive(rec.owner):
                continue  # another live agent is creating or closing it
            if rec.state == "suspended":
                report.reattached += 1  # on disk, no process: nothing to attach to
                continue
            if rec.state == "running" and orphan_worker(rec, self.owner):
                await self.lifecycle.retire(rec.id, reason="its function-call pool is gone")
                report.reclaimed_sandboxes += 1
                continue
            if rec.state == "running" and init_alive(rec):
                # A VM's control path is served by its agent's channel, which
                # died with that agent: this one serves it now.
                # (Only if nobody answers there: another live agent may.)
                runtime = self.runtimes.get(rec.kind)
                control = control_path(self.config.run_dir, rec.id)
                own_disk = is_disk(rec.spec["image"])  # no agent, no channel to serve
                if (
                    isinstance(runtime, Reattachable)
                    and not own_disk
                    and not await answers(control)
                ):
                    await runtime.attach(rec.id, control)
                if own_disk and not procs.owner_alive(rec.owner):
                    # Its guest's DHCP was answered by the agent that died
                    # (housekeeping also looks, each liveness interval).
                    self.lifecycle.networks.serve_dhcp(rec.id)
                report.reattached += 1
                continue
            if rec.state == "creating" and rec.owner == self.owner:
                continue  # our own create in flight
            await self.lifecycle.fail(rec, _WHY[rec.state])
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

    def _found(self) -> dict[str, set[str]]:
        """By resource kind, the refs of what is on the host (each named
        after a sandbox id, or a path ending in one)."""
        cfg = self.config
        found: dict[str, set[str]] = {
            "cgroup": self.cgroups.present(),
            "subvolume": set(self.scratch.names()),
            "dir": {str(p) for p in cfg.sandboxes_dir.iterdir()},
            "socket": {str(p) for p in cfg.run_dir.glob("*.sock")},
        }
        for runtime in self.runtimes.values():
            for kind, refs in runtime.leftovers().items():
                found.setdefault(kind, set()).update(refs)
        return found

    async def gc(self) -> GcReport:
        """Reclaim everything named after a sandbox that has no active record."""
        report = GcReport()
        db = self.store
        # Resource rows of finished sandboxes: a release that failed earlier.
        # Which sandboxes are active is read after the resources are seen:
        # records are written before resources, so a resource of a create
        # racing with us is in the set. One that closes meanwhile stays to
        # the next gc.
        rows = db.all_resources()
        active = db.active_ids()
        for sid, kind, ref in rows:
            if sid in active:
                continue
            try:
                await self.ledger.release(kind, ref)
                db.drop_resource(sid, kind, ref)
                report.count(kind)
            except Exception as exc:
                log.error("gc.release_failed", sandbox=sid, kind=kind, ref=ref, error=str(exc))
        prefix = f"{self.config.node}-"
        # Listing the host's cgroups, subvolumes, directories and runtime
        # state is thousands of reads at density: off the loop.
        found = await asyncio.to_thread(self._found)
        active = db.active_ids()
        for kind, refs in found.items():
            for ref in sorted(refs):
                sid = Path(ref).stem if kind in ("dir", "socket") else ref
                if not sid.startswith(prefix) or sid in active:
                    continue
                try:
                    await self.ledger.release(kind, ref)
                    report.count(kind)
                except Exception as exc:
                    log.error("gc.release_failed", sandbox=sid, kind=kind, error=str(exc))
        audit = self.lifecycle.audit
        for sid in await asyncio.to_thread(audit.seccompd.counted):
            if sid.startswith(prefix) and sid not in active:
                audit.keep_seccomp_counts(sid)  # what a release that never came left
        report.layers_released = len(self.layers.release_unused(db.referenced_layers))
        db.purge_closed(time.time() - PURGE_AFTER)
        if report.reclaimed:
            log.info("gc.reclaimed", reclaimed=report.reclaimed)
        return report
