"""The node agent: the one owner of a node's sandboxes.

It admits, prepares, starts, serves and closes sandboxes, keeping a record of
each and of everything each holds (node/store.py). It runs inside the
caller's process when embedded, or inside `corral serve`; several agents of
one node (several processes on one data dir) cooperate through the store,
and one of them at a time (the leader) enforces TTLs and reclaims leftovers.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import os
import secrets
import shutil
import signal as signals
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from corral import metrics
from corral.api.models import (
    VM_KINDS,
    AuditReport,
    CommitRequest,
    CreateSandbox,
    DisplayInput,
    ExecEvent,
    ExecExit,
    ExecOutput,
    ExecRequest,
    ExecStarted,
    FileEntry,
    FnCallRequest,
    FnCallResult,
    ForkRequest,
    LayerInfo,
    NetworkPolicy,
    SandboxInfo,
    SandboxState,
    SavedState,
    SaveRequest,
    check_path,
)
from corral.config import NodeConfig
from corral.errors import (
    CommandNotFound,
    Conflict,
    CorralError,
    FileError,
    ImageNotFound,
    InvalidArgument,
    NodeFull,
    NotFound,
    PermissionDenied,
    SandboxClosed,
    SandboxFailed,
    SandboxNotFound,
    Unavailable,
)
from corral.execd import protocol as proto
from corral.execd.client import ExecdClient, ExecSession
from corral.guard.dns import Resolver, upstream_from_resolv_conf
from corral.guard.network import NodeNetwork
from corral.guard.seccompd import SeccompDaemon, syscall_class
from corral.images import registry
from corral.images.build import build_from_dir
from corral.images.layer import Layer
from corral.images.lazy.loader import LazyLoader
from corral.images.mounter import LayerMounts
from corral.images.objects import ObjectStore, open_store
from corral.images.store import ImageStore
from corral.log import get_logger
from corral.node import cgroups as cg
from corral.node import platform as plat
from corral.node.scratch import Scratch
from corral.node.store import ACTIVE_STATES, SandboxRecord, Store
from corral.runtimes.base import Prepared, Runtime, process_start_time
from corral.runtimes.container.bundle import IDS
from corral.runtimes.container.oci import OciRuntime
from corral.runtimes.container.runtime import ContainerRuntime, control_path
from corral.runtimes.fncall.pool import POOL_LABEL
from corral.runtimes.fncall.runtime import FnCallRuntime
from corral.runtimes.fncall.service import FnCalls
from corral.runtimes.vm import states
from corral.runtimes.vm.display import Display
from corral.runtimes.vm.qemu import accelerator
from corral.runtimes.vm.runtime import TAP, FullVMRuntime, MicroVMRuntime, vm_capable

log = get_logger("corral.node")

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Host ids for sandbox user namespaces: block k is ID_BASE + k * IDS onwards,
# above the ids a host gives its own users and services.
ID_BASE = 1 << 20
ID_SLOTS = ((1 << 32) - ID_BASE) // IDS
READY_TIMEOUT = 30.0
FORK_LABEL = "corral.forked_from"  # on each copy: the id of its source
RESTORED_LABEL = "corral.restored_from"  # on a restored VM: the id it was saved from
KEY_LABEL = "corral.key"  # a gateway's idempotency key (corral.control.gateway)
EXEC_GRACE = 10.0  # how long past its timeout the agent waits for the exec server


def host_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def _owner_token() -> str:
    return f"{os.getpid()}:{process_start_time(os.getpid())}"


def owner_alive(token: str) -> bool:
    pid, _, start = token.partition(":")
    return str(process_start_time(int(pid))) == start


def merge_env(*layers: list[str] | dict[str, str]) -> list[str]:
    """KEY=VALUE lists/dicts merged left to right; later values win."""
    env: dict[str, str] = {}
    for layer in layers:
        items = (
            layer.items()
            if isinstance(layer, dict)
            else (e.split("=", 1) for e in layer if "=" in e)
        )
        for k, v in items:
            env[k] = v
    env.setdefault("PATH", DEFAULT_PATH)
    return [f"{k}={v}" for k, v in env.items()]


class _AlreadyCreated(Exception):
    """Control flow inside create: never raised out of the agent."""

    def __init__(self, sandbox_id: str) -> None:
        self.sandbox_id = sandbox_id


class NodeAgent:
    """Implements api.service.SandboxService for the sandboxes of one node."""

    def __init__(self, config: NodeConfig | None = None, *, reap_children: bool = False) -> None:
        self.config = config or NodeConfig.from_env()
        # Set where this process is a child subreaper (`corral serve`): the
        # sandboxes' init processes are then our children to reap. Never in
        # an embedded caller's process, whose children are its own business.
        self.reap_children = reap_children
        self._children: set[int] = set()
        self.owner = _owner_token()
        self.store: Store | None = None
        self.images = ImageStore(self.config.images_dir)
        lazy = (
            LazyLoader(
                self.config.data_dir,
                self.config.images_dir,
                cache_size=self.config.chunk_cache_size,
                readahead=self.config.lazy_readahead,
                deadline=self.config.lazy_deadline,
            )
            if self.config.lazy
            else None
        )
        self.layers = LayerMounts(self.images, self.config.mounts_dir, lazy)
        self.network = NodeNetwork(
            self.config.node,
            self.config.network_pool,
            self.config.dns_port,
            self.config.network_deny,
            self.config.ecosystems,
        )
        self._resolver: asyncio.DatagramTransport | None = None
        self.scratch = Scratch(
            self.config.scratch_dir, self.config.scratch_image, self.config.scratch_size
        )
        self.runtimes: dict[str, Runtime] = {}
        self.cgroups: cg.Cgroups | None = None
        self._sessions: dict[tuple[str, int], ExecSession] = {}
        self._activity: dict[str, float] = {}
        self._busy: dict[str, int] = {}
        self._maintenance: Any = None
        self._started = False
        self._host_memory = host_memory()
        self.fncall = FnCalls(self)

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> NodeAgent:
        if self._started:
            return self
        if os.geteuid() != 0:
            raise Unavailable(
                "the node agent needs root (mount(2), cgroups and namespaces need "
                "CAP_SYS_ADMIN); run as root or use a remote server: AsyncClient('http://...')"
            )
        cfg = self.config
        for d in (cfg.data_dir, cfg.sandboxes_dir, cfg.run_dir, cfg.platform_dir):
            d.mkdir(parents=True, exist_ok=True)
        # Sandbox ids, cgroups and leftovers are named after the node: one
        # data dir belongs to one node name for good.
        name_file = cfg.data_dir / "node"
        if not name_file.exists():
            name_file.write_text(cfg.node)
        if (recorded := name_file.read_text().strip()) != cfg.node:
            raise InvalidArgument(
                "node",
                f"must be {recorded!r}, the node this data dir ({cfg.data_dir}) belongs to",
                cfg.node,
            )
        platform = plat.install(cfg.platform_src / "bin", cfg.platform_dir)
        self.cgroups = cg.Cgroups(cfg.cgroup_parent)
        oci = OciRuntime(
            shutil.which(cfg.oci_runtime) or cfg.oci_runtime,
            cfg.crun_root,
            platform.nsexec,
            hybrid=self.cgroups.mode is cg.Mode.HYBRID,
        )
        self._nsexec = platform.nsexec
        self.seccompd = SeccompDaemon(cfg.data_dir, platform.seccompd)
        await asyncio.to_thread(self.seccompd.ensure)
        listener = self.seccompd.socket if cfg.seccomp else None
        self.runtimes = {
            "container": ContainerRuntime(oci, self.cgroups, platform, listener),
            "fncall": FnCallRuntime(oci, self.cgroups, platform, listener, cfg.fncall_tmpfs),
        }
        if vm_capable():
            self.runtimes["microvm"] = MicroVMRuntime(
                self.layers,
                self.cgroups,
                cfg.sandboxes_dir,
                free_page_reporting=cfg.vm_free_page_reporting,
            )
            self.runtimes["fullvm"] = FullVMRuntime(
                self.layers,
                self.cgroups,
                cfg.sandboxes_dir,
                free_page_reporting=cfg.vm_free_page_reporting,
                pmem_dir=cfg.data_dir / "pmem" if cfg.vm_pmem else None,
            )
        self.store = Store(cfg.db_path)
        await asyncio.to_thread(self.scratch.open)
        self._started = True
        from corral.node.maintenance import Maintenance

        self._maintenance = Maintenance(self)
        await self._maintenance.start()
        log.info("agent.started", node=cfg.node, data_dir=str(cfg.data_dir), owner=self.owner)
        return self

    async def aclose(self) -> None:
        if not self._started:
            return
        self._started = False
        was_leader = self._maintenance.is_leader
        await self.fncall.pool.aclose()
        await self._maintenance.stop()
        self.stop_resolver()
        for session in list(self._sessions.values()):
            session.close()
        for runtime in self.runtimes.values():
            if isinstance(runtime, MicroVMRuntime):
                # The VMs run on; the next agent re-attaches their channels.
                await runtime.detach_all()
        db = self._db()
        active, _ = db.count_active()
        if self.scratch.close(active) or was_leader:
            # The last agent of the node (or its leader) leaves no mount that
            # no sandbox needs.
            self.layers.release_unused(db.referenced_layers())
            if active == 0 and self.cgroups is not None:
                self.cgroups.remove_parent()
                self.seccompd.stop()
                self.network.remove_base()
        db.close()
        self.store = None
        log.info("agent.stopped", node=self.config.node, sandboxes_left=active)

    async def __aenter__(self) -> NodeAgent:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _db(self) -> Store:
        if self.store is None:
            raise Unavailable("the node agent is not started (or was closed)")
        return self.store

    # ---------------------------------------------------------------- create

    def _resolve_layers(self, req: CreateSandbox) -> list[Layer]:
        """Base first, then workspace, then toolkits in the order given."""
        layers = [self.images.resolve(req.image, "image")]
        if req.workspace:
            layers.append(self.images.resolve(req.workspace, "workspace"))
        layers += [self.images.resolve(t, f"toolkit[{i}]") for i, t in enumerate(req.toolkit)]
        return layers

    def _admit(
        self, req: CreateSandbox, rec: SandboxRecord, resources: builtins.list[tuple[str, str]]
    ) -> int | None:
        """Check capacity and record the sandbox with every resource it will
        hold, in one transaction, before any of them exists."""
        db = self._db()
        with db.transaction():
            count, promised = db.count_active()
            if count >= self.config.max_sandboxes:
                raise NodeFull(
                    f"node {self.config.node} is full: {count} sandboxes, "
                    f"max_sandboxes is {self.config.max_sandboxes}",
                    node=self.config.node,
                    reason="slots",
                )
            budget = int(self._host_memory * self.config.memory_overcommit)
            if promised + req.memory > budget:
                raise NodeFull(
                    f"node {self.config.node} cannot promise {req.memory} more bytes of memory: "
                    f"{promised} promised of {budget} "
                    f"(host memory x memory_overcommit {self.config.memory_overcommit})",
                    node=self.config.node,
                    reason="memory",
                )
            key = req.idempotency_key
            if key is not None:
                made = db.idempotent(key)
                earlier = db.get(made) if made is not None else None
                if earlier is not None and earlier.state == "failed":
                    db.idempotent_drop(key, earlier.id)  # a failed create may be retried
                elif made is not None:
                    raise _AlreadyCreated(made)
            db.insert(rec)
            if key is not None:
                db.idempotent_put(key, rec.id)
            for kind, ref in resources:
                db.add_resource(rec.id, kind, ref)
            if self.config.userns:
                db.add_resource(rec.id, "idmap", rec.id)
                db.idmap_allocate(rec.id, ID_SLOTS)
            if req.network is None:
                return None
            db.add_resource(rec.id, "net", rec.id)
            return db.net_allocate(rec.id, req.network.model_dump_json(), self.network.capacity)

    async def create(self, req: CreateSandbox, state: Path | None = None) -> SandboxInfo:
        if req.idempotency_key is not None:
            made = self._db().idempotent(req.idempotency_key)
            earlier = self._db().get(made) if made is not None else None
            if earlier is not None and earlier.state != "failed":
                return await self._made_by_key(earlier.id)
        try:
            return await self._create(req, state)
        except _AlreadyCreated as dup:  # a concurrent create with the same key won
            return await self._made_by_key(dup.sandbox_id)

    async def _made_by_key(self, sandbox_id: str) -> SandboxInfo:
        """The sandbox an earlier create with the same key made, once ready."""
        deadline = time.monotonic() + READY_TIMEOUT * 2
        while True:
            rec = self._record(sandbox_id)
            if rec.state != "creating":
                break
            if time.monotonic() > deadline:
                raise Unavailable(
                    f"sandbox {sandbox_id}, made for this idempotency key, is still being "
                    "created: retry later",
                    sandbox=sandbox_id,
                )
            await asyncio.sleep(0.02)
        if rec.state == "failed":
            raise SandboxFailed(
                f"the create with this idempotency key failed: {rec.error} (a retry with the "
                "same key creates it afresh)",
                sandbox=sandbox_id,
            )
        return self._info(rec)

    async def fork(self, sandbox_id: str, req: ForkRequest) -> builtins.list[SandboxInfo]:
        """`n` new VM sandboxes, each a copy of this one as it is now: its
        memory, processes and files. The source pauses while its state is
        saved (~0.1 s per 256 MiB), then runs on; each copy loads the state
        into a QEMU of its own (its own id, channel and cgroup)."""
        n = req.n
        rec = await self._awake(sandbox_id)
        runtime = self.runtimes.get(rec.kind)
        if not isinstance(runtime, MicroVMRuntime):
            raise InvalidArgument("kind", "fork is for microvm and fullvm sandboxes", rec.kind)
        if self._db().net_get(sandbox_id) is not None:
            # Every copy would wake up holding the source's address.
            raise InvalidArgument(
                "network",
                "a VM with a network cannot be forked (its copies share its address)",
                "policy",
            )
        keys: builtins.list[str | None] = (
            [*req.idempotency_keys] if req.idempotency_keys else [None] * n
        )

        def copy(key: str | None) -> CreateSandbox:
            labels = {**rec.labels, FORK_LABEL: sandbox_id}
            if key is not None and KEY_LABEL in labels:
                labels[KEY_LABEL] = key  # a gateway's key for this copy's row
            spec = {**rec.spec, "idempotency_key": key, "labels": labels}
            return CreateSandbox.model_validate(spec)

        state = self.config.sandboxes_dir / sandbox_id / f"fork-{secrets.token_hex(4)}.state"
        t0 = time.monotonic()
        try:
            size = await runtime.snapshot(sandbox_id, state)
            saved = time.monotonic() - t0
            results = await asyncio.gather(
                *(self.create(copy(key), state=state) for key in keys), return_exceptions=True
            )
        finally:
            state.unlink(missing_ok=True)
        made = [r for r in results if isinstance(r, SandboxInfo)]
        failed = [r for r in results if not isinstance(r, SandboxInfo)]
        if failed:
            # All or nothing: a caller asked for n copies of one moment.
            await asyncio.gather(*(self.close(i.id, "its fork failed") for i in made))
            first = failed[0]
            if isinstance(first, CorralError):
                raise first
            raise SandboxFailed(f"sandbox {sandbox_id}: fork failed: {first}") from first
        metrics.VM_OPS.labels("fork").observe(time.monotonic() - t0)
        metrics.VM_STATE_BYTES.labels("fork").inc(size)
        log.info(
            "sandbox.forked",
            sandbox=sandbox_id,
            copies=n,
            state_bytes=size,
            save_ms=round(saved * 1000, 1),
            ms=round((time.monotonic() - t0) * 1000, 1),
        )
        return made

    async def save(self, sandbox_id: str, req: SaveRequest) -> SavedState:
        """Suspend a VM (if it runs) and copy its state and its record to an
        object store, from which restore() starts it on any node with the
        same guest artefacts. The sandbox stays here, suspended: resume it,
        or close it once the copy runs elsewhere."""
        rec = self._record(sandbox_id)
        runtime = self.runtimes.get(rec.kind)
        if not isinstance(runtime, MicroVMRuntime):
            raise InvalidArgument("kind", "save is for microvm and fullvm sandboxes", rec.kind)
        if self._db().net_get(sandbox_id) is not None:
            raise InvalidArgument(
                "network", "a VM with a network cannot move (its address is this node's)", "policy"
            )
        store = open_store(req.store)
        if rec.state == "running":
            await self.suspend(sandbox_id)
        rec = self._record(sandbox_id)
        if rec.state != "suspended":
            raise Conflict(
                f"sandbox {sandbox_id} is {rec.state}, not suspended", sandbox=sandbox_id
            )
        key = f"vmstates/{sandbox_id}"
        state = self.config.sandboxes_dir / sandbox_id / "vm.state"
        guest_version = (await asyncio.to_thread(runtime.artefacts)).version
        t0 = time.monotonic()
        doc = {
            "sandbox": sandbox_id,
            "kind": rec.kind,
            "spec": rec.spec,
            "layers": rec.layers,
            "labels": rec.labels,
            "guest": guest_version,
            "state_sha256": await asyncio.to_thread(states.file_sha256, state),
        }
        record = json.dumps(doc).encode()
        mac = states.sign(states.load_key(self.config.state_key_path), key, record)
        await asyncio.to_thread(store.put_file, f"{key}/state", state)
        await asyncio.to_thread(store.put_bytes, f"{key}/saved.json", record)
        await asyncio.to_thread(store.put_bytes, f"{key}/mac", mac.encode())
        size = state.stat().st_size
        metrics.VM_OPS.labels("save").observe(time.monotonic() - t0)
        metrics.VM_STATE_BYTES.labels("save").inc(size)
        log.info("sandbox.saved", sandbox=sandbox_id, bytes=size, store=store.url,
                 ms=round((time.monotonic() - t0) * 1000, 1))  # fmt: skip
        return SavedState(
            store=req.store, key=key, sandbox=sandbox_id, kind=rec.kind, size=size,
            guest=guest_version,
        )  # fmt: skip

    async def restore(self, req: SavedState) -> SandboxInfo:
        """A new sandbox on this node from a saved VM state: its memory,
        processes and files as they were saved. The layers are the exact
        ones it was saved with (pulled from the store when this node lacks
        them); the guest artefacts must be the same version."""
        store = open_store(req.store)
        try:
            record = await asyncio.to_thread(store.get, f"{req.key}/saved.json")
            mac = (await asyncio.to_thread(store.get, f"{req.key}/mac")).decode(errors="replace")
        except NotFound:
            raise InvalidArgument("key", f"names no saved state in {store.url}", req.key) from None
        if not states.verify(states.load_key(self.config.state_key_path), req.key, record, mac):
            raise InvalidArgument(
                "key",
                "must name a state saved by a node sharing this node's state key "
                "(its record's signature does not match)",
                req.key,
            )
        doc = json.loads(record)
        runtime = self.runtimes.get(doc["kind"])
        if not isinstance(runtime, MicroVMRuntime):
            raise InvalidArgument("kind", "this node does not run it", doc["kind"])
        here = (await asyncio.to_thread(runtime.artefacts)).version
        if doc["guest"] != here:
            raise InvalidArgument(
                "guest",
                f"must match this node's guest artefacts ({here}): a state loads only into the "
                "kernel it was saved under",
                doc["guest"],
            )
        for digest in doc["layers"]:
            try:
                self.layers.store.get(digest)
            except ImageNotFound:
                await asyncio.to_thread(registry.pull, self.layers.store, digest, store, _quiet)
        spec, layers = dict(doc["spec"]), list(doc["layers"])
        # Exactly the saved layers, by digest: a tag may name another layer here.
        spec["image"] = layers.pop(0)
        if spec.get("workspace"):
            spec["workspace"] = layers.pop(0)
        spec["toolkit"] = layers
        labels = {**doc["labels"], RESTORED_LABEL: doc["sandbox"]}
        if req.idempotency_key is not None and KEY_LABEL in labels:
            labels[KEY_LABEL] = req.idempotency_key
        spec.update(labels=labels, idempotency_key=req.idempotency_key)
        local = self.config.sandboxes_dir / f".restore-{secrets.token_hex(6)}.state"
        try:
            await asyncio.to_thread(_download, store, f"{req.key}/state", local)
            # Checked before QEMU reads a byte of it (states.py says why).
            if await asyncio.to_thread(states.file_sha256, local) != doc["state_sha256"]:
                raise InvalidArgument(
                    "key", "its state file does not match its signed record", req.key
                )
            t0 = time.monotonic()
            info = await self.create(CreateSandbox.model_validate(spec), state=local)
            metrics.VM_OPS.labels("restore").observe(time.monotonic() - t0)
            return info
        finally:
            local.unlink(missing_ok=True)

    async def _create(self, req: CreateSandbox, state: Path | None = None) -> SandboxInfo:
        t0 = time.monotonic()
        runtime = self.runtimes.get(req.kind)
        if runtime is None:
            raise InvalidArgument(
                "kind", f"must be one this node runs: {', '.join(sorted(self.runtimes))}", req.kind
            )
        layers = self._resolve_layers(req)
        if req.network is not None:
            self.network.check(req.network)
        now = time.time()
        image_env = merge_env(*(layer.config.env for layer in layers))
        workdir = "/workspace" if req.workspace else (layers[0].config.workdir or "/")
        rec = SandboxRecord(
            id=f"{self.config.node}-{secrets.token_hex(8)}",
            kind=req.kind,
            state="creating",
            spec=req.model_dump(),
            layers=[layer.digest for layer in layers],
            image_env=image_env,
            workdir=workdir,
            created_at=now,
            expires_at=now + req.ttl if req.ttl else None,
            last_active=now,
            owner=self.owner,
            labels=dict(req.labels),
            image_user=next((x.config.user for x in reversed(layers) if x.config.user), None),
        )
        sandbox_dir = self.config.sandboxes_dir / rec.id
        sub = self.scratch.path(rec.id)
        prep = Prepared(
            lower=[self.layers.path(layer.digest) for layer in reversed(layers)],
            upper=sub / "upper",
            work=sub / "work",
            sandbox_dir=sandbox_dir,
            control=control_path(self.config.run_dir, rec.id),
            env=merge_env(image_env, req.env),
        )
        own = [("dir", str(sandbox_dir)), ("subvolume", rec.id)]
        net_index = self._admit(req, rec, own + runtime.resources(rec.id, prep))
        slot = self._db().idmap_slot(rec.id)
        if slot is not None:
            prep = replace(prep, host_id=ID_BASE + slot * IDS)
        db = self._db()
        phases: dict[str, float] = {}
        mark = time.monotonic()

        def phase(name: str) -> None:
            nonlocal mark
            now = time.monotonic()
            phases[name] = round((now - mark) * 1000, 2)
            mark = now

        phase("admit")
        try:
            sandbox_dir.mkdir()
            (sandbox_dir / "stage").mkdir()
            self.scratch.create(rec.id, req.disk)  # two ioctls: ~0.1 ms
            if prep.host_id is not None:
                # The merged root is the upper's root: the sandbox's root owns it.
                os.chown(prep.upper, prep.host_id, prep.host_id)
            for layer in layers:
                self.layers.ensure(layer)
            phase("prepare")
            if isinstance(runtime, MicroVMRuntime):
                # A guest with a NIC is told its address at boot.
                net = None
                if req.network is not None and net_index is not None:
                    host_ip, guest_ip = self.network.addresses(net_index)
                    net = (guest_ip, host_ip)
                started = await runtime.start(rec, prep, state, net)
            else:
                started = await runtime.start(rec, prep)
            phase("start")
            if self.reap_children:
                self._children.add(started.pid)
            try:
                await self._wait_ready(rec.id, prep.control)
            except SandboxFailed as exc:
                console = getattr(runtime, "console_tail", None)
                if console is None:
                    raise
                # A guest that never answered: its console says why.
                raise SandboxFailed(
                    f"{exc.message}; the guest's last console lines:\n{console(rec.id)}",
                    sandbox=rec.id,
                ) from exc
            if req.network is not None and net_index is not None:
                tap = TAP if isinstance(runtime, MicroVMRuntime) else None
                await self._connect(rec.id, started.pid, net_index, req.network, tap)
                phase("network")
            phase("ready")
            if not db.transition(
                rec.id, ["creating"], "running", init_pid=started.pid, init_start=started.pid_start
            ):
                raise SandboxClosed(f"sandbox {rec.id} was closed while it was being created")
        except BaseException as exc:
            await self._release(rec.id, "failed", f"create failed: {exc}")
            if req.idempotency_key is not None:
                # A retry with the same key may try again.
                db.idempotent_drop(req.idempotency_key, rec.id)
            code = exc.code if isinstance(exc, CorralError) else "internal"
            metrics.SANDBOX_CREATE_FAILURES.labels(code).inc()
            log.warning("sandbox.create_failed", sandbox=rec.id, error=str(exc))
            raise
        elapsed = time.monotonic() - t0
        metrics.SANDBOXES_CREATED.labels(req.kind).inc()
        metrics.CREATE_SECONDS.labels(req.kind).observe(elapsed)
        log.info(
            "sandbox.created", sandbox=rec.id, kind=req.kind, ms=round(elapsed * 1000, 2), **phases
        )
        return self._info(self._record(rec.id))

    async def _wait_ready(self, sandbox_id: str, control: Path) -> None:
        client = ExecdClient(str(control))
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            try:
                version, _pid = await client.ping()
            except (Unavailable, ConnectionError):
                if time.monotonic() > deadline:
                    raise SandboxFailed(
                        f"sandbox {sandbox_id}: exec server did not answer within "
                        f"{READY_TIMEOUT:.0f}s",
                        sandbox=sandbox_id,
                    ) from None
                await asyncio.sleep(0.005)
                continue
            if version != proto.VERSION:
                raise SandboxFailed(
                    f"sandbox {sandbox_id}: exec server speaks protocol {version}, "
                    f"the agent {proto.VERSION}",
                    sandbox=sandbox_id,
                )
            return

    # ---------------------------------------------------------------- release

    async def release_resource(self, kind: str, ref: str) -> None:
        """Release one resource; idempotent (releasing a gone thing is fine)."""
        for runtime in self.runtimes.values():
            if await runtime.release(kind, ref):
                return
        if kind == "subvolume":
            await asyncio.to_thread(self.scratch.destroy, ref)
        elif kind == "dir":
            await asyncio.to_thread(shutil.rmtree, ref, True)
        elif kind == "socket":
            Path(ref).unlink(missing_ok=True)
        elif kind == "net":
            await asyncio.to_thread(self._disconnect, ref)
        elif kind == "idmap":
            self._db().idmap_free(ref)
        else:
            raise ValueError(f"unknown resource kind {kind!r}")

    async def _release(self, sandbox_id: str, final_state: str, reason: str) -> None:
        """Release every resource of the sandbox, newest first, dropping each
        record once it is gone, then mark the sandbox final_state."""
        db = self._db()
        errors = []
        self._snapshot_cgroup_audit(sandbox_id)
        for kind, ref in db.resources(sandbox_id):
            try:
                await self.release_resource(kind, ref)
                db.drop_resource(sandbox_id, kind, ref)
            except Exception as exc:  # keep going: gc retries what is left
                errors.append(f"{kind} {ref}: {exc}")
                log.error(
                    "resource.release_failed",
                    sandbox=sandbox_id,
                    kind=kind,
                    ref=ref,
                    error=str(exc),
                )
        for key in [k for k in self._sessions if k[0] == sandbox_id]:
            self._sessions.pop(key).close()
        self.reap()
        self._activity.pop(sandbox_id, None)
        db.update(
            sandbox_id,
            state=final_state,
            closed_at=time.time(),
            error=(reason + ("; " + "; ".join(errors) if errors else "")) or None,
        )

    async def close(self, sandbox_id: str, reason: str = "closed by caller") -> None:
        """Close a caller's sandbox (the node's own workers are not theirs)."""
        self._not_a_worker(self._record(sandbox_id))
        await self.retire(sandbox_id, reason)

    async def retire(self, sandbox_id: str, reason: str) -> None:
        """Close any sandbox of the node: the node's own path (TTL, idle,
        pools, recovery)."""
        rec = self._record(sandbox_id)
        db = self._db()
        if rec.state in ("closed", "failed"):
            return
        if not db.transition(sandbox_id, ["running", "suspended"], "closing"):
            if rec.state == "creating" and rec.owner == self.owner:
                # Our own create is in flight: it sees the state and unwinds.
                db.transition(sandbox_id, ["creating"], "closing")
            return
        await self._release(sandbox_id, "closed", reason)
        metrics.SANDBOXES_CLOSED.labels(rec.kind, reason.split(" ")[0]).inc()
        log.info("sandbox.closed", sandbox=sandbox_id, reason=reason)

    # ---------------------------------------------------------------- queries

    def _record(self, sandbox_id: str) -> SandboxRecord:
        if not isinstance(sandbox_id, str) or not sandbox_id:
            raise InvalidArgument("sandbox_id", "must be a non-empty string", sandbox_id)
        rec = self._db().get(sandbox_id)
        if rec is None:
            node = sandbox_id.rsplit("-", 1)[0]
            where = "" if node == self.config.node else f" (its id names node {node!r})"
            raise SandboxNotFound(
                f"no sandbox {sandbox_id!r} on node {self.config.node!r}{where}",
                sandbox=sandbox_id,
            )
        return rec

    def _not_a_worker(self, rec: SandboxRecord) -> None:
        if POOL_LABEL in rec.labels:
            raise PermissionDenied(
                f"sandbox {rec.id} is one of the node's function-call workers: "
                "use client.fncall, not the sandbox API",
                sandbox=rec.id,
            )

    async def _awake(self, sandbox_id: str) -> SandboxRecord:
        """The record of a running sandbox; a suspended one is resumed
        first (the next request restores it)."""
        if self._record(sandbox_id).state == "suspended":
            await self.resume(sandbox_id)
        return self._running(sandbox_id)

    async def suspend(self, sandbox_id: str) -> SandboxInfo:
        """Save a running microVM to disk and stop it; its memory and its
        processes come back on resume() (or on the next request)."""
        rec = self._running(sandbox_id)
        runtime = self.runtimes.get(rec.kind)
        if not hasattr(runtime, "suspend"):
            raise InvalidArgument(
                "kind", "suspend is supported for microvm sandboxes (containers: to come)", rec.kind
            )
        db = self._db()
        if not db.transition(sandbox_id, ["running"], "suspending"):
            raise Conflict(f"sandbox {sandbox_id} is busy changing state", sandbox=sandbox_id)
        t0 = time.monotonic()
        try:
            size = await runtime.suspend(sandbox_id)  # type: ignore[union-attr]
        except BaseException:
            db.transition(sandbox_id, ["suspending"], "running")
            raise
        db.transition(sandbox_id, ["suspending"], "suspended")
        metrics.VM_OPS.labels("suspend").observe(time.monotonic() - t0)
        metrics.VM_STATE_BYTES.labels("suspend").inc(size)
        log.info(
            "sandbox.suspended",
            sandbox=sandbox_id,
            ms=round((time.monotonic() - t0) * 1000, 1),
            state_bytes=size,
        )
        return self._info(self._record(sandbox_id))

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        """Restore a suspended microVM; a running sandbox is left as it is."""
        rec = self._record(sandbox_id)
        if rec.state == "running":
            return self._info(rec)
        db = self._db()
        if not db.transition(sandbox_id, ["suspended"], "resuming"):
            for _ in range(3000):  # another request is resuming it: wait for that
                rec = self._record(sandbox_id)
                if rec.state != "resuming":
                    break
                await asyncio.sleep(0.01)
            return self._info(self._running(sandbox_id))
        t0 = time.monotonic()
        runtime = self.runtimes[rec.kind]
        try:
            started = await runtime.resume(sandbox_id)  # type: ignore[attr-defined]
            if self.reap_children:
                self._children.add(started.pid)
            await self._wait_ready(sandbox_id, control_path(self.config.run_dir, sandbox_id))
            row = db.net_get(sandbox_id)
            if row is not None:
                # The new QEMU has a new namespace and tap: the sandbox's veth
                # died with the old one. Same address, same policy.
                await asyncio.to_thread(self.network.detach, row[0])
                policy = NetworkPolicy.model_validate_json(row[1])
                await self._connect(sandbox_id, started.pid, row[0], policy, TAP)
        except BaseException as exc:
            db.transition(sandbox_id, ["resuming"], "suspended")
            if isinstance(exc, CorralError):
                raise
            raise SandboxFailed(f"sandbox {sandbox_id}: resume failed: {exc}") from exc
        db.transition(
            sandbox_id,
            ["resuming"],
            "running",
            init_pid=started.pid,
            init_start=started.pid_start,
        )
        metrics.VM_OPS.labels("resume").observe(time.monotonic() - t0)
        log.info("sandbox.resumed", sandbox=sandbox_id, ms=round((time.monotonic() - t0) * 1000, 1))
        return self._info(self._record(sandbox_id))

    async def _display(self, sandbox_id: str) -> Display:
        rec = await self._awake(sandbox_id)
        runtime = self.runtimes.get(rec.kind)
        if not isinstance(runtime, FullVMRuntime):
            raise InvalidArgument(
                "kind", "has no display: only fullvm sandboxes have one", rec.kind
            )
        w, h = rec.spec["display_size"]
        return runtime.display(sandbox_id, (int(w), int(h)))

    async def screenshot(self, sandbox_id: str) -> bytes:
        """The screen as QEMU shows it, a PNG."""
        png = await (await self._display(sandbox_id)).screenshot()
        metrics.DISPLAY_OPS.labels("screenshot").inc()
        return png

    async def display_input(self, sandbox_id: str, req: DisplayInput) -> None:
        display = await self._display(sandbox_id)
        if req.action == "click":
            assert req.x is not None and req.y is not None
            await display.click(req.x, req.y, req.button, req.count)
        elif req.action == "move":
            assert req.x is not None and req.y is not None
            await display.move(req.x, req.y)
        elif req.action == "type":
            await display.type(req.text or "")
        else:
            await display.key(req.keys or "")
        metrics.DISPLAY_OPS.labels(req.action).inc()
        self._activity[sandbox_id] = time.time()

    def _running(self, sandbox_id: str) -> SandboxRecord:
        rec = self._record(sandbox_id)
        self._not_a_worker(rec)
        if rec.state != "running":
            if rec.state in ("closed", "closing"):
                raise SandboxClosed(
                    f"sandbox {sandbox_id} is {rec.state}"
                    + (f": {rec.error}" if rec.error else ""),
                    sandbox=sandbox_id,
                )
            if rec.state == "failed":
                raise SandboxFailed(f"sandbox {sandbox_id} failed: {rec.error}", sandbox=sandbox_id)
            raise SandboxClosed(f"sandbox {sandbox_id} is still {rec.state}", sandbox=sandbox_id)
        self._activity[sandbox_id] = time.time()
        return rec

    def _info(self, rec: SandboxRecord) -> SandboxInfo:
        s = rec.spec
        return SandboxInfo(
            id=rec.id,
            node=self.config.node,
            kind=rec.kind,
            state=SandboxState(rec.state),
            image=s["image"],
            workspace=s.get("workspace"),
            toolkit=s.get("toolkit", []),
            layers=rec.layers,
            cpu=s["cpu"],
            memory=s["memory"],
            disk=s["disk"],
            pids=s["pids"],
            ttl=s.get("ttl"),
            idle_timeout=s.get("idle_timeout"),
            env=s.get("env", {}),
            labels=rec.labels,
            created_at=rec.created_at,
            expires_at=rec.expires_at,
            error=rec.error,
            workdir=rec.workdir,
            display_size=s.get("display_size"),
            **self._net_info(rec.id),
        )

    def _net_info(self, sandbox_id: str) -> dict[str, Any]:
        row = self._db().net_get(sandbox_id)
        if row is None:
            return {}
        return {
            "network": NetworkPolicy.model_validate_json(row[1]),
            "address": self.network.addresses(row[0])[1],
        }

    async def get(self, sandbox_id: str) -> SandboxInfo:
        return self._info(self._record(sandbox_id))

    def capacity(self, labelled: str = "corral.project") -> dict[str, Any]:
        """What this node can still take, for placement (its heartbeat).
        `held` counts the sandboxes a gateway made (they carry `labelled`)."""
        db = self._db()
        count, promised = db.count_active()
        return {
            "max_sandboxes": self.config.max_sandboxes,
            "active": count,
            "held": db.count_labelled(labelled),
            "memory_budget": int(self._host_memory * self.config.memory_overcommit),
            "memory_promised": promised,
            "cpus": os.cpu_count() or 1,
            "kinds": sorted(self.runtimes),
            "vm_accel": accelerator() if "microvm" in self.runtimes else None,
            "images": self.images.names(),
        }

    async def list(self, labels: dict[str, str] | None = None) -> builtins.list[SandboxInfo]:
        records = self._db().list(ACTIVE_STATES, labels)
        if not labels or POOL_LABEL not in labels:
            # Pooled function-call workers are the platform's, not the caller's.
            records = [r for r in records if POOL_LABEL not in r.labels]
        return [self._info(r) for r in records]

    # ---------------------------------------------------------------- exec

    def _client(self, sandbox_id: str) -> ExecdClient:
        return ExecdClient(str(control_path(self.config.run_dir, sandbox_id)))

    def execd(self, sandbox_id: str) -> ExecdClient:
        """The exec server of a sandbox, for the node's own services."""
        return self._client(sandbox_id)

    def require_cgroups(self) -> cg.Cgroups:
        if self.cgroups is None:
            raise Unavailable("the node agent is not started (or was closed)")
        return self.cgroups

    async def run_call(self, req: FnCallRequest) -> FnCallResult:
        return await self.fncall.run(req)

    async def exec(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        rec = await self._awake(sandbox_id)
        argv = [plat.SHELL, "-c", req.cmd] if isinstance(req.cmd, str) else list(req.cmd)
        env = merge_env(rec.image_env, rec.spec.get("env", {}), req.env)
        t0 = time.monotonic()
        try:
            session = await self._client(sandbox_id).start(
                argv,
                env,
                user=req.user or rec.image_user or "root",
                cwd=req.cwd or rec.workdir,
                timeout=req.timeout,
                stdout_cap=req.stdout_limit,
                stderr_cap=req.stderr_limit,
                stdin=req.stdin,
            )
        except Unavailable:
            raise self._gone(sandbox_id) from None
        key = (sandbox_id, session.pid)
        self._sessions[key] = session
        self._busy[sandbox_id] = self._busy.get(sandbox_id, 0) + 1
        outcome = "error"
        exit_event: ExecExit | None = None
        try:
            yield ExecStarted(pid=session.pid)
            limit = req.timeout + EXEC_GRACE if req.timeout else None
            events = session.events()
            while True:
                try:
                    kind, payload = await asyncio.wait_for(anext(events), limit)
                except StopAsyncIteration:
                    raise self._gone(sandbox_id) from None
                except TimeoutError:
                    raise SandboxFailed(
                        f"sandbox {sandbox_id}: exec server did not end pid {session.pid} "
                        f"{EXEC_GRACE:.0f}s after its timeout",
                        sandbox=sandbox_id,
                    ) from None
                except ConnectionError:
                    raise self._gone(sandbox_id) from None
                if kind == proto.RSP_EXIT:
                    x = proto.parse_exit(payload)
                    dropped = max(0, x.stdout_bytes - req.stdout_limit) + max(
                        0, x.stderr_bytes - req.stderr_limit
                    )
                    if dropped:
                        metrics.OUTPUT_DROPPED.inc(dropped)
                    outcome = "timeout" if x.timed_out else "ok"
                    exit_event = ExecExit(
                        exit_code=x.exit_code,
                        signal=x.signal,
                        timed_out=x.timed_out,
                        stdout_bytes=x.stdout_bytes,
                        stderr_bytes=x.stderr_bytes,
                        cpu_user=x.cpu_user,
                        cpu_system=x.cpu_system,
                        max_rss=x.max_rss,
                        duration=time.monotonic() - t0,
                    )
                    if rec.kind == "fncall" and self._busy.get(sandbox_id) == 1:
                        # Stateless: once nothing runs, nothing of it is
                        # kept; wiped before the caller hears the exit, so
                        # its next command starts clean.
                        await self._reset_stateless(sandbox_id)
                    yield exit_event
                    return
                yield ExecOutput(
                    type="stdout" if kind == proto.RSP_STDOUT else "stderr", data=payload
                )
        finally:
            session.close()
            self._sessions.pop(key, None)
            self._account(sandbox_id, argv, req, outcome, exit_event, t0)
            self._busy[sandbox_id] -= 1
            if not self._busy[sandbox_id]:
                del self._busy[sandbox_id]
                if rec.kind == "fncall" and exit_event is None:
                    await self._reset_stateless(sandbox_id)
            self._activity[sandbox_id] = time.time()
            metrics.EXEC_TOTAL.labels(outcome).inc()
            metrics.EXEC_SECONDS.observe(time.monotonic() - t0)

    async def _reset_stateless(self, sandbox_id: str) -> None:
        try:
            await self.fncall.reset(sandbox_id)
        except (CorralError, OSError) as exc:  # a dead reset handler: a closed connection
            log.warning("fncall.reset_failed", sandbox=sandbox_id, error=str(exc))

    def _account(
        self,
        sandbox_id: str,
        argv: builtins.list[str],
        req: ExecRequest,
        outcome: str,
        x: ExecExit | None,
        t0: float,
    ) -> None:
        db = self.store
        if db is None or db.get(sandbox_id) is None:
            return
        db.count(sandbox_id, "commands")
        entry: dict[str, Any] = {
            "ts": time.time(),
            "argv": [a[:512] for a in argv[-3:]],
            "user": req.user,
            "outcome": outcome,
        }
        if x is not None:
            dropped = max(0, x.stdout_bytes - req.stdout_limit) + max(
                0, x.stderr_bytes - req.stderr_limit
            )
            if x.timed_out:
                db.count(sandbox_id, "commands_timed_out")
            if dropped:
                db.count(sandbox_id, "output_truncated")
                db.count(sandbox_id, "output_dropped_bytes", dropped)
            entry.update(
                exit_code=x.exit_code,
                signal=x.signal,
                stdout_bytes=x.stdout_bytes,
                stderr_bytes=x.stderr_bytes,
                seconds=round(x.duration, 3),
            )
        else:
            entry["seconds"] = round(time.monotonic() - t0, 3)
        self._log_command(sandbox_id, entry)

    def _gone(self, sandbox_id: str) -> CorralError:
        """The exec server stopped answering: say why, from the record."""
        rec = self._db().get(sandbox_id)
        if rec is None or rec.state in ("closed", "closing"):
            return SandboxClosed(f"sandbox {sandbox_id} was closed", sandbox=sandbox_id)
        return SandboxFailed(
            f"sandbox {sandbox_id}: lost its exec server (the sandbox died?)", sandbox=sandbox_id
        )

    async def kill(self, sandbox_id: str, pid: int, signal: int = signals.SIGKILL) -> None:
        """Signal a command's process group; pid 0 means every process of
        the sandbox but its init."""
        await self._awake(sandbox_id)
        if not 0 < signal < 65:
            raise InvalidArgument("signal", "must be a signal number between 1 and 64", signal)
        if pid < 0 or pid == 1:
            raise InvalidArgument("pid", "must be a command's pid, or 0 for all processes", pid)
        self._db().count(sandbox_id, "commands_killed")
        session = self._sessions.get((sandbox_id, pid))
        if session is not None:
            await session.signal(signal)
            return
        try:
            await self._client(sandbox_id).kill(pid, signal)
        except FileError as exc:
            raise CommandNotFound(
                f"no command with pid {pid} in sandbox {sandbox_id}", sandbox=sandbox_id, pid=pid
            ) from exc

    # ---------------------------------------------------------------- files

    async def read_file(self, sandbox_id: str, path: str, user: str = "root") -> bytes:
        path = check_path(path)
        await self._awake(sandbox_id)
        metrics.FILE_OPS.labels("read").inc()
        return await self._client(sandbox_id).read(user, path, self.config.max_file_bytes)

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes, user: str = "root", mode: int = 0o644
    ) -> int:
        path = check_path(path)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgument("data", "must be bytes", type(data).__name__)
        if len(data) > self.config.max_file_bytes:
            raise InvalidArgument(
                "data", f"must be at most {self.config.max_file_bytes} bytes per file", data
            )
        if not 0 <= mode <= 0o7777:
            raise InvalidArgument("mode", "must be a permission mode between 0 and 0o7777", mode)
        await self._awake(sandbox_id)
        metrics.FILE_OPS.labels("write").inc()
        return await self._client(sandbox_id).write(
            user, path, bytes(data), mode=mode, max_bytes=self.config.max_file_bytes
        )

    async def list_files(
        self, sandbox_id: str, path: str, user: str = "root"
    ) -> builtins.list[FileEntry]:
        path = check_path(path)
        await self._awake(sandbox_id)
        metrics.FILE_OPS.labels("list").inc()
        entries = await self._client(sandbox_id).list(user, path)
        return sorted(
            (_entry(e, f"{path.rstrip('/')}/{e.name}") for e in entries), key=lambda e: e.name
        )

    async def stat_file(self, sandbox_id: str, path: str, user: str = "root") -> FileEntry:
        path = check_path(path)
        await self._awake(sandbox_id)
        return _entry(await self._client(sandbox_id).stat(user, path), path)

    async def make_dir(self, sandbox_id: str, path: str, user: str = "root") -> None:
        path = check_path(path)
        await self._awake(sandbox_id)
        await self._client(sandbox_id).mkdir(user, path)

    async def remove_file(
        self, sandbox_id: str, path: str, user: str = "root", recursive: bool = True
    ) -> None:
        path = check_path(path)
        if path == "/":
            raise InvalidArgument("path", "must not be the sandbox's root", path)
        await self._awake(sandbox_id)
        metrics.FILE_OPS.labels("remove").inc()
        await self._client(sandbox_id).remove(user, path, recursive=recursive)

    async def _run_platform(
        self, sandbox_id: str, argv: builtins.list[str], stdin: bytes | None, doing: str
    ) -> bytes:
        """Run a platform tool (from /.corral) and return its stdout."""
        limit = self.config.max_file_bytes
        req = ExecRequest(cmd=argv, timeout=600, stdin=stdin, stdout_limit=limit)
        out: builtins.list[bytes] = []
        err: builtins.list[bytes] = []
        code, total = -1, 0
        async for ev in self.exec(sandbox_id, req):
            if isinstance(ev, ExecOutput):
                (out if ev.type == "stdout" else err).append(ev.data)
            elif isinstance(ev, ExecExit):
                code, total = ev.exit_code, ev.stdout_bytes
        if total > limit:
            raise InvalidArgument(
                "path", f"must hold at most {limit} bytes to download as a tar", f"<{total} bytes>"
            )
        if code != 0:
            raise FileError(f"{doing}: {b''.join(err).decode(errors='replace').strip()}")
        return b"".join(out)

    async def upload_tar(self, sandbox_id: str, path: str, data: bytes) -> None:
        path = check_path(path)
        if len(data) > self.config.max_file_bytes:
            raise InvalidArgument(
                "data", f"must be at most {self.config.max_file_bytes} bytes", data
            )
        await self.make_dir(sandbox_id, path)
        metrics.FILE_OPS.labels("upload_tar").inc()
        await self._run_platform(
            sandbox_id,
            [plat.BUSYBOX, "tar", "-x", "-C", path],
            bytes(data),
            f"extracting a tar into {path}",
        )

    async def download_tar(self, sandbox_id: str, path: str) -> bytes:
        path = check_path(path)
        metrics.FILE_OPS.labels("download_tar").inc()
        return await self._run_platform(
            sandbox_id,
            [plat.BUSYBOX, "tar", "-c", "-C", path, "."],
            None,
            f"archiving {path}",
        )

    def reap(self) -> None:
        """Collect the exit status of our sandboxes' dead init processes."""
        for pid in list(self._children):
            try:
                done, _status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid  # not ours (adopted before a restart) or gone
            if done:
                self._children.discard(pid)

    # ---------------------------------------------------------------- network

    async def _connect(
        self, sandbox_id: str, pid: int, index: int, policy: NetworkPolicy, tap: str | None = None
    ) -> None:
        """Give a running sandbox its interface and policy, and point its
        resolver at the node's (the only DNS it can reach anyway). A VM's
        `pid` is its QEMU, and its veth is bridged to the VM's `tap`."""
        att = await asyncio.to_thread(self.network.attach, index, pid, tap)
        await asyncio.to_thread(self.network.apply, index, policy)
        client = self._client(sandbox_id)
        try:
            await client.remove("root", "/etc/resolv.conf", recursive=False)
        except CorralError:
            pass
        await client.write(
            "root",
            "/etc/resolv.conf",
            f"nameserver {att.host_ip}\n".encode(),
            max_bytes=4096,
            mkdirs=True,
        )

    def _disconnect(self, sandbox_id: str) -> None:
        db = self._db()
        row = db.net_get(sandbox_id)
        if row is None:
            return
        denied = self.network.denied(row[0])
        if denied:
            db.count(sandbox_id, "egress_denied", denied)
        self.network.detach(row[0])
        db.net_free(sandbox_id)

    async def update_network(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo:
        """Change where a running sandbox may connect (loose while its
        environment is set up, tight while the task is solved)."""
        rec = await self._awake(sandbox_id)
        self.network.check(policy)
        db = self._db()
        row = db.net_get(sandbox_id)
        if row is None and rec.kind in VM_KINDS:
            raise InvalidArgument(
                "network",
                "a VM created without network cannot get one later (its NIC exists from boot): "
                "create it with a policy, even an empty one",
                "policy",
            )
        if row is None:  # created without network: give it an interface now
            with db.transaction():
                db.add_resource(sandbox_id, "net", sandbox_id)
                index = db.net_allocate(sandbox_id, policy.model_dump_json(), self.network.capacity)
            assert rec.init_pid is not None
            await self._connect(sandbox_id, rec.init_pid, index, policy)
        else:
            await asyncio.to_thread(self.network.apply, row[0], policy)
            db.net_set_policy(sandbox_id, policy.model_dump_json())
        log.info(
            "network.updated",
            sandbox=sandbox_id,
            domains=len(policy.domains),
            cidrs=len(policy.cidrs),
            ecosystems=sorted(k for k, v in policy.ecosystems.items() if v),
        )
        return self._info(self._record(sandbox_id))

    def _policy_of(self, ip: str) -> tuple[str, int, NetworkPolicy] | None:
        index = self.network.index_of(ip)
        if index is None or self.store is None:
            return None
        row = self.store.net_by_index(index)
        if row is None:
            return None
        return row[0], index, NetworkPolicy.model_validate_json(row[1])

    async def start_resolver(self) -> None:
        """The node's DNS for sandboxes (run by the leader agent)."""
        if self._resolver is not None:
            return
        loop = asyncio.get_running_loop()
        db = self._db()
        try:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: Resolver(
                    lookup=self._policy_of,
                    allowed_names=self.network.allowed_names,
                    learn=self.network.learn,
                    denied=lambda sid: db.count(sid, "dns_denied"),
                    hosts=self.config.dns_hosts,
                    upstream=self.config.dns_upstream or upstream_from_resolv_conf(),
                ),
                local_addr=("0.0.0.0", self.config.dns_port),
            )
        except OSError as exc:
            log.error("dns.bind_failed", port=self.config.dns_port, error=str(exc))
            return
        self._resolver = transport
        log.info("dns.serving", port=self.config.dns_port)

    def stop_resolver(self) -> None:
        if self._resolver is not None:
            self._resolver.close()
            self._resolver = None

    # ---------------------------------------------------------------- layers

    async def commit(self, sandbox_id: str, req: CommitRequest) -> LayerInfo:
        """The sandbox's writable layer (what it changed over its image), as a
        new image layer: how a toolkit or workspace is built by a script or
        by an agent. Taken from a read-only btrfs snapshot, so the sandbox
        may keep running."""
        rec = await self._awake(sandbox_id)
        db = self._db()
        snap = f".commit-{sandbox_id}-{secrets.token_hex(4)}"
        db.add_resource(sandbox_id, "subvolume", snap)  # recorded before made
        try:
            path = await asyncio.to_thread(self.scratch.snapshot, sandbox_id, snap)
            src, wrap = path / "upper", None
            slot = db.idmap_slot(sandbox_id)
            if slot is not None:
                # The upper holds the sandbox's host ids: read it through a
                # view that shifts them back, so the layer is root's again.
                src = self.config.sandboxes_dir / sandbox_id / "stage" / "commit"
                src.mkdir(exist_ok=True)
                base = ID_BASE + slot * IDS
                wrap = [
                    str(self._nsexec),
                    "--view",
                    str(path / "upper"),
                    str(src),
                    f"{base} 0 {IDS}",
                    "--",
                ]
            layer = await asyncio.to_thread(
                build_from_dir,
                self.images,
                src,
                tag=req.tag,
                kind=req.kind,
                parent=rec.layers[-1],
                labels={"corral.source": f"commit:{sandbox_id}"},
                wrap=wrap,
                measure=path / "upper",
            )
        finally:
            await asyncio.to_thread(self.scratch.destroy, snap)
            db.drop_resource(sandbox_id, "subvolume", snap)
        log.info("layer.committed", sandbox=sandbox_id, digest=layer.digest, tag=req.tag)
        return layer_info(layer)

    # ---------------------------------------------------------------- activity

    # ---------------------------------------------------------------- audit

    def _log_command(self, sandbox_id: str, entry: dict[str, Any]) -> None:
        """Append to the sandbox's command log on the host, within its quota.
        Command output is never logged: only what ran and how it ended."""
        path = self.config.sandboxes_dir / sandbox_id / "commands.log"
        line = (json.dumps(entry, default=str)[:4096] + "\n").encode()
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = 0
        db = self._db()
        if size + len(line) > self.config.log_quota:
            if not db.counters(sandbox_id).get("log_quota_hits"):
                marker = json.dumps({"event": "log quota reached", "quota": self.config.log_quota})
                with open(path, "ab") as f:
                    f.write(marker.encode() + b"\n")
            db.count(sandbox_id, "log_quota_hits")
            return
        with open(path, "ab") as f:
            f.write(line)

    def _snapshot_cgroup_audit(self, sandbox_id: str) -> None:
        """Keep the kernel's counters before the cgroup goes away."""
        if self.cgroups is None:
            return
        db = self._db()
        for key, value in (
            ("oom_kills", self.cgroups.oom_kills(sandbox_id)),
            ("pids_limit_hits", self.cgroups.pids_limit_hits(sandbox_id)),
        ):
            if value:
                db.count(sandbox_id, key, value)

    async def audit(self, sandbox_id: str) -> AuditReport:
        rec = self._record(sandbox_id)
        counters = self._db().counters(sandbox_id)
        report = AuditReport(sandbox=sandbox_id)
        for key, value in counters.items():
            if key in AuditReport.model_fields:
                setattr(report, key, value)
        if rec.state == "running" and self.cgroups is not None:
            report.oom_kills += self.cgroups.oom_kills(sandbox_id)
            report.pids_limit_hits += self.cgroups.pids_limit_hits(sandbox_id)
            usage = await asyncio.to_thread(self.scratch.usage, sandbox_id)
            if usage is not None:
                report.disk_used, report.disk_limit = usage
        for slot, n in self.seccompd.counts(sandbox_id).items():
            cls, name = syscall_class(slot)
            report.syscalls_denied[cls] = report.syscalls_denied.get(cls, 0) + n
            report.syscalls[name] = report.syscalls.get(name, 0) + n
        row = self._db().net_get(sandbox_id)
        if row is not None:
            report.egress_denied += self.network.denied(row[0])
        log_path = self.config.sandboxes_dir / sandbox_id / "commands.log"
        report.log_bytes = log_path.stat().st_size if log_path.exists() else 0
        return report

    def flush_activity(self) -> None:
        """Record when each sandbox was last used (running commands count)."""
        now = time.time()
        for sid in self._busy:
            self._activity[sid] = now
        if self._activity and self.store is not None:
            self.store.touch(self._activity)
            self._activity = {}


def _quiet(task: str, done: float, total: float | None) -> None:
    pass


def _download(store: ObjectStore, key: str, dest: Path, step: int = 8 << 20) -> None:
    size = store.size(key)
    with open(dest, "wb") as f:
        for off in range(0, size, step):
            f.write(store.get_range(key, off, min(step, size - off)))


def layer_info(layer: Layer) -> LayerInfo:
    return LayerInfo(
        digest=layer.digest,
        names=layer.names,
        kind=layer.kind,
        parent=layer.parent,
        content_size=layer.content_size,
        meta_size=layer.meta_size,
        blob_size=layer.blob_size,
        chunk_size=layer.chunk_size,
        created=layer.created,
    )


def _entry(e: proto.Entry, path: str) -> FileEntry:
    kinds = {"f": "file", "d": "dir", "l": "symlink"}
    return FileEntry(
        name=e.name.rsplit("/", 1)[-1] or "/",
        path=path,
        type=kinds.get(e.kind, "other"),  # type: ignore[arg-type]
        size=e.size,
        mode=e.mode & 0o7777,
        mtime=e.mtime_ns / 1e9,
    )
