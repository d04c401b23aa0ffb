"""Admission: the node's final say on whether a sandbox may start here.

A create is admitted and recorded, with every resource it will hold, in one
BEGIN IMMEDIATE transaction before any of them exists: the count of
sandboxes, the memory and CPUs promised and the idempotency key are read
and written under one write lock, so two processes admitting at once on one
node cannot both take the last slot. Promises may exceed the host by the
overcommit ratios (most sandboxes idle); what the host measures decides
too: free memory under its reserve, or a pressure stall average at its
limit, refuses before neighbours suffer (docs/admission.md). A refusal is
NodeFull with its reason: a gateway then places the sandbox on another
node.
"""

from __future__ import annotations

import builtins
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from corral import labels, metrics
from corral.api.models import CreateSandbox
from corral.capacity import NodeCapacity
from corral.config import NodeConfig
from corral.errors import NodeFull
from corral.host import pressure as psi
from corral.node.store import Promised, SandboxRecord, Store
from corral.runtimes.container.bundle import IDS

# Host ids for sandbox user namespaces: block k is ID_BASE + k * IDS onwards,
# above the ids a host gives its own users and services.
ID_BASE = 1 << 20
ID_SLOTS = ((1 << 32) - ID_BASE) // IDS


# The pool label's value of a warm sandbox (node/warmpool.py).
WARM = "warm"


class NotWarm(Exception):
    """Control flow inside a claim: the warm sandbox was taken or closed
    meanwhile; the pool tries its next one. Never raised out of the node."""


class AlreadyCreated(Exception):
    """Control flow inside create: a concurrent create with the same
    idempotency key won the race. Never raised out of the node."""

    def __init__(self, sandbox_id: str) -> None:
        self.sandbox_id = sandbox_id


# PSI's averages move over seconds: the host is asked at most this often.
MEASURE_EVERY = 0.5


@dataclass(frozen=True)
class HostLoad:
    """What the host measures: free memory and stall averages."""

    mem_available: int | None
    stalls: dict[str, psi.Stall]

    @classmethod
    def read(cls) -> HostLoad:
        return cls(psi.mem_available(), psi.read())


def overloaded(load: HostLoad, reserve: int, limits: dict[str, float]) -> tuple[str, str] | None:
    """(reason, message) when the host is too loaded to take one more
    sandbox, else None. cpu is judged by `some` (a runnable task waited for
    a core), memory and io by `full` (every task stalled at once): a busy
    CPU is what overcommit is for, a stalled memory or disk is not."""
    if reserve and load.mem_available is not None and load.mem_available < reserve:
        return "memory_free", (
            f"{load.mem_available} bytes of memory free, under memory_reserve {reserve}"
        )
    for res, limit in sorted(limits.items()):
        stall = load.stalls.get(res)
        if stall is None:
            continue
        value, which = (stall.some, "some") if res == "cpu" else (stall.full, "full")
        if value >= limit:
            return "pressure", (
                f"{res} pressure ({which} avg10) is {value:.2f}%, at or over its limit {limit:g}% "
                "(pressure_limits)"
            )
    return None


class Admission:
    def __init__(
        self,
        config: NodeConfig,
        store: Store,
        host_memory: int,
        net_capacity: int,
        measure: Callable[[], HostLoad] = HostLoad.read,
        listeners: tuple[int, frozenset[str]] | None = None,
    ) -> None:
        """`listeners`: (how many, which kinds) when each sandbox of those
        kinds holds one of the seccomp daemon's open files (its listener):
        that many at most are admitted at once."""
        self.config = config
        self.listeners = listeners
        self.store = store
        self.memory_budget = int(host_memory * config.memory_overcommit)
        self.cpus = os.cpu_count() or 1
        # 0: CPUs promised are not checked (config.cpu_overcommit None).
        self.cpu_budget = self.cpus * (config.cpu_overcommit or 0.0)
        self.net_capacity = net_capacity
        self._measure = measure
        self._load: tuple[float, HostLoad] | None = None

    def host_load(self) -> HostLoad:
        now = time.monotonic()
        if self._load is None or now - self._load[0] >= MEASURE_EVERY:
            self._load = (now, self._measure())
        return self._load[1]

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
            promised = db.promised()
            if promised.sandboxes >= cfg.max_sandboxes:
                raise self._full(
                    f"node {cfg.node} is full: {promised.sandboxes} sandboxes, "
                    f"max_sandboxes is {cfg.max_sandboxes}",
                    "slots",
                )
            self._listener_free(req, promised)
            self._promise(req, promised, 0, 0.0, 0)
            key = req.idempotency_key
            self._key_free(key)
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

    def claim(self, req: CreateSandbox, sandbox_id: str) -> int | None:
        """A warm sandbox (node/warmpool.py) becomes the claimant's, in one
        transaction: the budgets are checked for what changes (its CPU,
        memory and disk were promised when it was made) and the host as for
        any create, the idempotency key is taken, and its record becomes
        the claimant's (spec, sizes, labels, times). Returns the network
        block, as admit() does. NotWarm: it was taken or closed meanwhile."""
        db = self.store
        with db.transaction():
            rec = db.get(sandbox_id)
            if rec is None or rec.state != "running" or rec.labels.get(labels.POOL) != WARM:
                raise NotWarm(sandbox_id)
            was = rec.spec
            self._promise(req, db.promised(), was["memory"], was["cpu"], was["disk"])
            key = req.idempotency_key
            self._key_free(key)
            if key is not None:
                db.idempotent_put(key, sandbox_id)
            now = time.time()
            db.update(
                sandbox_id,
                spec=json.dumps(req.model_dump()),
                memory=req.memory,
                cpu=req.cpu,
                disk=req.disk,
                created_at=now,
                last_active=now,
                expires_at=now + req.ttl if req.ttl else None,
            )
            db.set_labels(sandbox_id, dict(req.labels))
            if req.network is None:
                return None
            db.add_resource(sandbox_id, "net", sandbox_id)
            return db.net_allocate(sandbox_id, req.network.model_dump_json(), self.net_capacity)

    def _listener_free(self, req: CreateSandbox, promised: Promised) -> None:
        """Past the seccomp daemon's open files a new container's listener
        could not be handed over (crun would fail with 'send listener fd
        to receiver'): refused here, naming the limit, instead. Only
        counted by kind when every active sandbox together could reach it."""
        if self.listeners is None:
            return
        most, kinds = self.listeners
        if req.kind not in kinds or promised.sandboxes < most:
            return
        held = self.store.count_active(kinds)
        if held >= most:
            raise self._full(
                f"node {self.config.node} is full: {held} sandboxes hold a seccomp listener, "
                f"the most the seccomp daemon's open files allow (its RLIMIT_NOFILE, less its "
                f"own and the function-call workers') is {most}",
                "seccomp_files",
            )

    def _key_free(self, key: str | None) -> None:
        """Raise AlreadyCreated if an earlier create with `key` made a
        sandbox; one whose create failed gives its key up (a retry may try
        again). Inside the admitting transaction."""
        if key is None:
            return
        db = self.store
        made = db.idempotent(key)
        earlier = db.get(made) if made is not None else None
        if earlier is not None and earlier.state == "failed":
            db.idempotent_drop(key, earlier.id)
        elif made is not None:
            raise AlreadyCreated(made)

    def _promise(
        self,
        req: CreateSandbox,
        promised: Promised,
        *already: float,
    ) -> None:
        """Memory, CPUs and disk may be promised up to their budgets, and the
        host must not measure itself overloaded. `already`: the memory, CPUs
        and disk the sandbox holds now (a warm one's, counted in the sums)."""
        cfg = self.config
        was_memory, was_cpu, was_disk = already
        memory_promised = promised.memory - int(was_memory)
        if memory_promised + req.memory > self.memory_budget:
            raise self._full(
                f"node {cfg.node} cannot promise {req.memory} more bytes of memory: "
                f"{memory_promised} promised of {self.memory_budget} "
                f"(host memory x memory_overcommit {cfg.memory_overcommit})",
                "memory",
            )
        cpu_promised = promised.cpu - was_cpu
        if self.cpu_budget and cpu_promised + req.cpu > self.cpu_budget + 1e-9:
            raise self._full(
                f"node {cfg.node} cannot promise {req.cpu:g} more CPUs: "
                f"{cpu_promised:g} promised of {self.cpu_budget:g} "
                f"({self.cpus} CPUs x cpu_overcommit {cfg.cpu_overcommit:g})",
                "cpu",
            )
        self._admit_disk(req.disk, promised.disk - int(was_disk))
        over = overloaded(self.host_load(), cfg.memory_reserve, cfg.pressure_limits)
        if over is not None:
            raise self._full(f"node {cfg.node} is too loaded: {over[1]}", over[0])

    def _full(self, message: str, reason: str) -> NodeFull:
        metrics.NODE_FULL.labels(reason).inc()
        return NodeFull(message, node=self.config.node, reason=reason)

    def _admit_disk(self, disk: int, promised: int) -> None:
        """Writable space, by the memory rule: what is promised (`promised`:
        to the others) may exceed the scratch pool by disk_overcommit (each
        sandbox is held to its own quota, and most write little), but no one
        sandbox may be promised more than the whole pool (it could fill it
        for every neighbour)."""
        cfg = self.config
        pool = cfg.scratch_size
        if disk > pool:
            raise self._full(
                f"node {cfg.node} cannot give {disk} bytes of disk to one sandbox: "
                f"its scratch pool holds {pool}",
                "disk",
            )
        budget = int(pool * cfg.disk_overcommit)
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
        promised = self.store.promised()
        cfg = self.config
        over = overloaded(self.host_load(), cfg.memory_reserve, cfg.pressure_limits)
        return NodeCapacity(
            max_sandboxes=cfg.max_sandboxes,
            active=promised.sandboxes,
            held=self.store.count_labelled(labels.PROJECT),
            memory_budget=self.memory_budget,
            memory_promised=promised.memory,
            cpus=self.cpus,
            cpu_budget=self.cpu_budget,
            cpu_promised=promised.cpu,
            overloaded="" if over is None else over[1],
            kinds=tuple(sorted(kinds)),
            vm_accel=vm_accel,
            images=tuple(images),
            tags=inventory[0],
            layers=inventory[1],
        )
