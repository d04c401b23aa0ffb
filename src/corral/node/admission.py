"""Admission: the node's final say on whether a sandbox may start here.

A create is admitted and recorded, with every resource it will hold, in one
BEGIN IMMEDIATE transaction before any of them exists: the count of
sandboxes, the memory promised and the idempotency key are read and written
under one write lock, so two processes admitting at once on one node cannot
both take the last slot. A refusal is NodeFull (with its reason): a gateway
then places the sandbox on another node.
"""

from __future__ import annotations

import builtins
import os

from corral import labels, metrics
from corral.api.models import CreateSandbox
from corral.capacity import NodeCapacity
from corral.config import NodeConfig
from corral.errors import NodeFull
from corral.node.store import SandboxRecord, Store
from corral.runtimes.container.bundle import IDS

# Host ids for sandbox user namespaces: block k is ID_BASE + k * IDS onwards,
# above the ids a host gives its own users and services.
ID_BASE = 1 << 20
ID_SLOTS = ((1 << 32) - ID_BASE) // IDS


class AlreadyCreated(Exception):
    """Control flow inside create: a concurrent create with the same
    idempotency key won the race. Never raised out of the node."""

    def __init__(self, sandbox_id: str) -> None:
        self.sandbox_id = sandbox_id


class Admission:
    def __init__(
        self, config: NodeConfig, store: Store, host_memory: int, net_capacity: int
    ) -> None:
        self.config = config
        self.store = store
        self.memory_budget = int(host_memory * config.memory_overcommit)
        self.net_capacity = net_capacity

    def earlier(self, key: str | None) -> str | None:
        """The sandbox an earlier create with this key made, unless that
        create failed (a failed create may be retried)."""
        if key is None:
            return None
        made = self.store.idempotent(key)
        earlier = self.store.get(made) if made is not None else None
        return earlier.id if earlier is not None and earlier.state != "failed" else None

    def admit(
        self, req: CreateSandbox, rec: SandboxRecord, resources: builtins.list[tuple[str, str]]
    ) -> int | None:
        """Check capacity and record the sandbox with every resource it will
        hold, in one transaction, before any of them exists. Returns the
        sandbox's network block, if it asked for a network."""
        db, cfg = self.store, self.config
        with db.transaction():
            count, promised = db.count_active()
            if count >= cfg.max_sandboxes:
                raise self._full(
                    f"node {cfg.node} is full: {count} sandboxes, "
                    f"max_sandboxes is {cfg.max_sandboxes}",
                    "slots",
                )
            if promised + req.memory > self.memory_budget:
                raise self._full(
                    f"node {cfg.node} cannot promise {req.memory} more bytes of memory: "
                    f"{promised} promised of {self.memory_budget} "
                    f"(host memory x memory_overcommit {cfg.memory_overcommit})",
                    "memory",
                )
            self._admit_disk(req.disk)
            key = req.idempotency_key
            if key is not None:
                made = db.idempotent(key)
                earlier = db.get(made) if made is not None else None
                if earlier is not None and earlier.state == "failed":
                    db.idempotent_drop(key, earlier.id)  # a failed create may be retried
                elif made is not None:
                    raise AlreadyCreated(made)
            db.insert(rec)
            if key is not None:
                db.idempotent_put(key, rec.id)
            for kind, ref in resources:
                db.add_resource(rec.id, kind, ref)
            if cfg.userns:
                db.add_resource(rec.id, "idmap", rec.id)
                db.idmap_allocate(rec.id, ID_SLOTS)
            if req.network is None:
                return None
            db.add_resource(rec.id, "net", rec.id)
            return db.net_allocate(rec.id, req.network.model_dump_json(), self.net_capacity)

    def _full(self, message: str, reason: str) -> NodeFull:
        metrics.NODE_FULL.labels(reason).inc()
        return NodeFull(message, node=self.config.node, reason=reason)

    def _admit_disk(self, disk: int) -> None:
        """Writable space, by the memory rule: what is promised may exceed
        the scratch pool by disk_overcommit (each sandbox is held to its own
        quota, and most write little), but no one sandbox may be promised
        more than the whole pool (it could fill it for every neighbour)."""
        cfg = self.config
        pool = cfg.scratch_size
        if disk > pool:
            raise self._full(
                f"node {cfg.node} cannot give {disk} bytes of disk to one sandbox: "
                f"its scratch pool holds {pool}",
                "disk",
            )
        budget = int(pool * cfg.disk_overcommit)
        promised = self.store.disk_promised()
        if promised + disk > budget:
            raise self._full(
                f"node {cfg.node} cannot promise {disk} more bytes of disk: {promised} "
                f"promised of {budget} (scratch pool x disk_overcommit {cfg.disk_overcommit})",
                "disk",
            )

    def host_id(self, sandbox_id: str) -> int | None:
        """The first host uid/gid of the sandbox's user namespace."""
        slot = self.store.idmap_slot(sandbox_id)
        return None if slot is None else ID_BASE + slot * IDS

    def capacity(
        self,
        kinds: builtins.list[str],
        vm_accel: str | None,
        images: builtins.list[str],
        inventory: tuple[dict[str, str], dict[str, tuple[str, int]]] = ({}, {}),
    ) -> NodeCapacity:
        """What this node can still take, for placement (its heartbeat).
        `held` counts the sandboxes a gateway made (labelled with a project)."""
        count, promised = self.store.count_active()
        return NodeCapacity(
            max_sandboxes=self.config.max_sandboxes,
            active=count,
            held=self.store.count_labelled(labels.PROJECT),
            memory_budget=self.memory_budget,
            memory_promised=promised,
            cpus=os.cpu_count() or 1,
            kinds=tuple(sorted(kinds)),
            vm_accel=vm_accel,
            images=tuple(images),
            tags=inventory[0],
            layers=inventory[1],
        )
