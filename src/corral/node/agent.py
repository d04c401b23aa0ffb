"""The node agent: the one owner of a node's sandboxes, and the front of
its parts (node/wiring.py draws them).

It runs inside the caller's process when embedded, or inside `corral
serve`; several agents of one node (several processes on one data dir)
cooperate through the store, and one of them at a time (the leader) enforces
TTLs and reclaims leftovers. This class only routes each operation of the
sandbox service (api/service.py) to the part that does it; a request that
needs a running sandbox wakes it first (a suspended one is resumed).
"""

from __future__ import annotations

import asyncio
import builtins
import json
import signal as signals
from collections.abc import AsyncIterator, Mapping

from corral.api import verdict
from corral.api.models import (
    MAX_PROTECTED,
    ApiKey,
    App,
    AuditReport,
    CommitRequest,
    CreateKey,
    CreateSandbox,
    DirectAccess,
    DisplayInput,
    DisplayState,
    Event,
    ExecEvent,
    ExecRequest,
    FileEntry,
    FnCallRequest,
    FnCallResult,
    ForkRequest,
    LaunchRequest,
    LayerInfo,
    LogLine,
    NetworkPolicy,
    ProtectRequest,
    RolloutReport,
    RolloutStep,
    SandboxInfo,
    SavedState,
    SaveRequest,
    Usage,
    ViewAccess,
    Window,
    XattrRequest,
)
from corral.capacity import NodeCapacity
from corral.config import NodeConfig
from corral.errors import Conflict, InvalidArgument, SandboxClosed, Unavailable
from corral.guard.network import NodeNetwork
from corral.host.procs import owner_token
from corral.host.scratch import Scratch
from corral.images.lazy.loader import LazyLoader
from corral.images.mounter import LayerMounts
from corral.images.store import ImageStore
from corral.labels import ROLLOUT
from corral.log import get_logger
from corral.node.commit import layer_info
from corral.node.fncall.service import FnCalls
from corral.node.recovery import GcReport
from corral.node.states import ALL as ALL_STATES
from corral.node.steplog import check_name
from corral.node.store import Store
from corral.node.wiring import NodeParts, require_root, start_parts
from corral.runtimes.base import Runtime
from corral.runtimes.vm.qemu import accelerator

log = get_logger("corral.node")
_NO_KEYS = (
    "API keys are a cluster gateway's (corral project key): this node's server has the one "
    "key it was started with"
)


class NodeAgent:
    """Implements api.service.SandboxService for the sandboxes of one node."""

    def __init__(self, config: NodeConfig | None = None, *, reap_children: bool = False) -> None:
        self.config = config or NodeConfig.from_env()
        # Set where this process is a child subreaper (`corral serve`): the
        # sandboxes' init processes are then our children to reap. Never in
        # an embedded caller's process, whose children are its own business.
        self.reap_children = reap_children
        self.owner = owner_token()
        cfg = self.config
        self.images = ImageStore(cfg.images_dir)
        lazy = (
            LazyLoader(
                cfg.data_dir,
                cfg.images_dir,
                cache_size=cfg.chunk_cache_size,
                readahead=cfg.lazy_readahead,
                deadline=cfg.lazy_deadline,
            )
            if cfg.lazy
            else None
        )
        self.layers = LayerMounts(self.images, cfg.mounts_dir, lazy)
        self.network = NodeNetwork(
            cfg.node, cfg.network_pool, cfg.dns_port, cfg.network_deny, cfg.ecosystems
        )
        self.scratch = Scratch(cfg.scratch_dir, cfg.scratch_image, cfg.scratch_size)
        self._parts: NodeParts | None = None

    # ---------------------------------------------------------------- start, stop

    async def start(self) -> NodeAgent:
        if self._parts is not None:
            return self
        require_root()
        self._parts = await start_parts(
            self.config,
            owner=self.owner,
            reap_children=self.reap_children,
            layers=self.layers,
            network=self.network,
            scratch=self.scratch,
        )
        log.info(
            "agent.started", node=self.config.node, data_dir=str(self.config.data_dir),
            owner=self.owner,
        )  # fmt: skip
        return self

    async def aclose(self) -> None:
        parts, self._parts = self._parts, None
        if parts is None:
            return
        active = await parts.close(self.layers, self.network, self.scratch)
        log.info("agent.stopped", node=self.config.node, sandboxes_left=active)

    async def __aenter__(self) -> NodeAgent:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def parts(self) -> NodeParts:
        if self._parts is None:
            raise Unavailable("the node agent is not started (or was closed)")
        return self._parts

    @property
    def store(self) -> Store:
        """The node's records (read them, for tools and tests; the parts
        write them)."""
        return self.parts.store

    @property
    def runtimes(self) -> Mapping[str, Runtime]:
        return self.parts.runtimes

    @property
    def fncall(self) -> FnCalls:
        return self.parts.fncall

    # ---------------------------------------------------------------- node

    def capacity(self) -> NodeCapacity:
        """What this node can still take, for placement (its heartbeat)."""
        p = self.parts
        tags, layers = self.images.inventory()
        return p.admission.capacity(
            list(p.runtimes),
            accelerator() if "microvm" in p.runtimes else None,
            sorted(tags),
            (tags, layers),
        )

    @property
    def recovered(self) -> GcReport | None:
        """What this agent reclaimed when it took the node's lead."""
        return self.parts.housekeeping.recovered

    async def recover(self) -> GcReport:
        """Recovery and gc now (`corral gc`)."""
        return await self.parts.recovery.recover()

    # ---------------------------------------------------------------- sandboxes

    async def create(self, req: CreateSandbox) -> SandboxInfo:
        p = self.parts
        return await p.warm.claim(req) or await p.lifecycle.create(req)

    async def get(self, sandbox_id: str) -> SandboxInfo:
        p = self.parts
        return p.records.info(p.records.get(sandbox_id))

    async def list(self, labels: dict[str, str] | None = None) -> builtins.list[SandboxInfo]:
        return self.parts.records.list(labels)

    async def close(self, sandbox_id: str) -> None:
        await self.parts.lifecycle.close(sandbox_id)

    async def suspend(self, sandbox_id: str, mode: str = "", key: str = "") -> SandboxInfo:
        return await self.parts.snapshots.suspend(sandbox_id, mode or None, key or None)

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        return await self.parts.snapshots.resume(sandbox_id)

    async def set_ttl(self, sandbox_id: str, ttl: int) -> SandboxInfo:
        return await self.parts.lifecycle.set_ttl(sandbox_id, ttl)

    async def fork(self, sandbox_id: str, req: ForkRequest) -> builtins.list[SandboxInfo]:
        return await self.parts.snapshots.fork(sandbox_id, req)

    async def save(self, sandbox_id: str, req: SaveRequest) -> SavedState:
        return await self.parts.snapshots.save(sandbox_id, req)

    async def restore(self, req: SavedState) -> SandboxInfo:
        return await self.parts.snapshots.restore(req)

    async def update_network(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo:
        p = self.parts
        rec = await p.snapshots.awake(sandbox_id)
        await p.networks.update(rec, policy, p.runtimes[rec.kind].net_tap)
        return p.records.info(p.records.get(sandbox_id))

    async def commit(self, sandbox_id: str, req: CommitRequest) -> LayerInfo:
        p = self.parts
        return await p.commits.commit(await p.snapshots.awake(sandbox_id), req)

    async def list_layers(self, labels: dict[str, str] | None = None) -> builtins.list[LayerInfo]:
        want = labels or {}
        found = await asyncio.to_thread(self.images.list)
        used = self.parts.store.referenced_layers()
        return [
            layer_info(x, x.digest in used)
            for x in found
            if all(x.labels.get(k) == v for k, v in want.items())
        ]

    async def delete_layer(self, ref: str) -> None:
        layer = self.images.resolve(ref, "ref")
        if layer.digest in self.parts.store.referenced_layers():
            raise Conflict(f"layer {ref!r} is in use by a sandbox of this node", ref=ref)
        self.images.untag(layer.digest)
        self.images.remove(layer.digest)
        log.info("layer.deleted", digest=layer.digest, ref=ref)

    async def audit(self, sandbox_id: str) -> AuditReport:
        p = self.parts
        return await p.audit.report(p.records.get(sandbox_id))

    async def direct(self, sandbox_id: str, ttl: int = 300) -> DirectAccess:
        # A node is the end of a direct path, not where one is issued.
        raise InvalidArgument(
            "sandbox_id", "a direct path is issued by a gateway, for a node behind it; "
            "this is a node: talk to it directly already", sandbox_id,
        )  # fmt: skip

    async def protect(self, sandbox_id: str, req: ProtectRequest) -> SandboxInfo:
        p = self.parts
        rec = p.records.get(sandbox_id)
        if rec.kind != "container":
            raise InvalidArgument(
                "kind", "protected paths are watched in containers only", rec.kind
            )
        if rec.state != "running":
            raise SandboxClosed(f"sandbox {sandbox_id} is {rec.state}", sandbox=sandbox_id)
        paths = sorted(set(rec.spec.get("protected") or []) | set(req.paths))
        if len(paths) > MAX_PROTECTED:
            raise InvalidArgument("paths", f"at most {MAX_PROTECTED} paths a sandbox", len(paths))
        await p.audit.misbehaviour.protect(rec, req.paths)
        p.store.update(sandbox_id, spec=json.dumps({**rec.spec, "protected": paths}))
        return p.records.info(p.records.get(sandbox_id))

    async def rollout_report(self, rollout: str) -> RolloutReport:
        p = self.parts
        recs = p.store.list(states=ALL_STATES, labels={ROLLOUT: check_name(rollout)})
        return verdict.rollout_report(rollout, [await p.audit.report(r) for r in recs])

    def events(self, labels: dict[str, str] | None = None) -> AsyncIterator[Event]:
        return self.parts.events.subscribe(labels)

    async def command_log(
        self, sandbox_id: str, since_ms: int = 0, limit: int = 1000
    ) -> builtins.list[LogLine]:
        if not 1 <= limit <= 10_000:
            raise InvalidArgument("limit", "must be between 1 and 10000", limit)
        p = self.parts
        p.records.get(sandbox_id)  # NotFound for no such sandbox
        return await asyncio.to_thread(p.audit.command_log, sandbox_id, since_ms / 1000, limit)

    async def usage(self, sandbox_id: str) -> Usage:
        p = self.parts
        return await p.audit.usage(p.records.get(sandbox_id))

    # ---------------------------------------------------------------- commands

    async def exec(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        p = self.parts
        rec = await p.snapshots.awake(sandbox_id)
        run = p.sessions.exec if req.key is None else p.keyed.exec
        async for event in run(rec, req):
            yield event

    async def kill(self, sandbox_id: str, pid: int, signal: int = signals.SIGKILL) -> None:
        p = self.parts
        await p.sessions.kill(await p.snapshots.awake(sandbox_id), pid, signal)

    async def send_stdin(self, sandbox_id: str, pid: int, data: bytes, eof: bool = False) -> None:
        p = self.parts
        await p.sessions.send_stdin(p.records.running(sandbox_id), pid, data, eof)

    async def resize_pty(self, sandbox_id: str, pid: int, rows: int, cols: int) -> None:
        p = self.parts
        await p.sessions.resize_pty(p.records.running(sandbox_id), pid, rows, cols)

    async def run_call(self, req: FnCallRequest) -> FnCallResult:
        return await self.parts.fncall.run(req)

    # ---------------------------------------------------------------- rollout logs
    # One tenant per node: a gateway keeps its projects' logs itself.

    async def rollout_steps(self, rollout: str) -> builtins.list[RolloutStep]:
        return await self.parts.steplog.steps("", rollout)

    async def rollout_append(self, rollout: str, step: RolloutStep) -> None:
        await self.parts.steplog.append("", rollout, step)

    async def rollout_delete(self, rollout: str) -> None:
        await self.parts.steplog.delete("", rollout)

    # ---------------------------------------------------------------- API keys
    # A cluster's (control/keys.py): a node's server has the one key it was
    # started with (--api-key).

    async def create_key(self, req: CreateKey) -> ApiKey:
        raise Unavailable(_NO_KEYS)

    async def list_keys(self, project: str = "") -> builtins.list[ApiKey]:
        raise Unavailable(_NO_KEYS)

    async def revoke_key(self, key_id: str) -> ApiKey:
        raise Unavailable(_NO_KEYS)

    # ---------------------------------------------------------------- files

    async def read_file(
        self, sandbox_id: str, path: str, user: str = "", follow_symlinks: bool = True
    ) -> bytes:
        return await self.parts.files.read(sandbox_id, path, user, follow_symlinks)

    async def write_file(
        self,
        sandbox_id: str,
        path: str,
        data: bytes,
        user: str = "",
        mode: int = 0o644,
        follow_symlinks: bool = True,
    ) -> int:
        return await self.parts.files.write(sandbox_id, path, data, user, mode, follow_symlinks)

    async def list_files(
        self, sandbox_id: str, path: str, user: str = ""
    ) -> builtins.list[FileEntry]:
        return await self.parts.files.list(sandbox_id, path, user)

    async def stat_file(self, sandbox_id: str, path: str, user: str = "") -> FileEntry:
        return await self.parts.files.stat(sandbox_id, path, user)

    async def make_dir(self, sandbox_id: str, path: str, user: str = "") -> None:
        await self.parts.files.make_dir(sandbox_id, path, user)

    async def set_xattrs(self, sandbox_id: str, req: XattrRequest) -> None:
        await self.parts.files.set_xattrs(sandbox_id, req)

    async def remove_file(
        self, sandbox_id: str, path: str, user: str = "", recursive: bool = True
    ) -> None:
        await self.parts.files.remove(sandbox_id, path, user, recursive)

    async def upload_tar(self, sandbox_id: str, path: str, data: bytes) -> None:
        await self.parts.files.upload_tar(sandbox_id, path, data)

    async def download_tar(self, sandbox_id: str, path: str) -> bytes:
        return await self.parts.files.download_tar(sandbox_id, path)

    # ---------------------------------------------------------------- display

    async def screenshot(
        self, sandbox_id: str, percent: int = 100, x: int = 0, y: int = 0, width: int = 0,
        height: int = 0,
    ) -> bytes:  # fmt: skip
        return await self.parts.displays.screenshot(sandbox_id, percent, x, y, width, height)

    async def display_input(self, sandbox_id: str, req: DisplayInput) -> None:
        await self.parts.displays.input(sandbox_id, req)

    async def display_state(self, sandbox_id: str) -> DisplayState:
        return await self.parts.displays.state(sandbox_id)

    async def display_windows(self, sandbox_id: str) -> builtins.list[Window]:
        return await self.parts.displays.windows(sandbox_id)

    async def display_apps(self, sandbox_id: str) -> builtins.list[App]:
        return await self.parts.displays.apps(sandbox_id)

    async def display_view(
        self, sandbox_id: str, interactive: bool = False, ttl: int = 300
    ) -> ViewAccess:
        return await self.parts.displays.view(sandbox_id, interactive, ttl)

    async def display_launch(self, sandbox_id: str, req: LaunchRequest) -> App:
        return await self.parts.displays.launch(sandbox_id, req)
