"""One project's view of a gateway: the sandbox API as that project sees it.

Most operations name a sandbox and are forwarded, unchanged, to its node
(control/forwarding.py, from the route table); this module holds their
routing and what a gateway does itself: create (placement, quota, moving a
create a node refused), list (every node), close (the row too), exec (a
stream watched for its node's loss), restore and fork (charged like
creates), commit (placed on at once), function calls (any node with room).
Every operation that makes sandboxes follows one sequence: reserve a row
per sandbox (charging the project's quota), ask the node, then mark each
row ready or, on an error, failed (releasing the charge): _reserve, _make.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from corral import ids, metrics, trace
from corral import labels as platform_labels
from corral.api import direct, verdict
from corral.api.models import (
    VM_KINDS,
    AuditReport,
    CommitRequest,
    CreateSandbox,
    DirectAccess,
    Event,
    ExecEvent,
    ExecRequest,
    FnCallRequest,
    FnCallResult,
    ForkRequest,
    LayerInfo,
    RolloutReport,
    RolloutStep,
    SandboxInfo,
    SavedState,
)
from corral.api.service import SandboxService
from corral.control import burst, keys, nodes, project_images, project_layers, sandboxes, spill
from corral.control.core import GatewayCore, NodeLost
from corral.control.events import merged as merged_events
from corral.control.forwarding import Forwarding
from corral.control.sandboxes import SandboxRow
from corral.control.view_keys import KeyOps
from corral.errors import (
    Conflict,
    CorralError,
    InternalError,
    InvalidArgument,
    NodeFull,
    ResourceExhausted,
    SandboxClosed,
    SandboxLost,
    SandboxNotFound,
    Unavailable,
)
from corral.log import get_logger

log = get_logger("corral.gateway")
T = TypeVar("T")
Made = SandboxInfo | builtins.list[SandboxInfo]


class _Refused(Exception):
    """A node's answer a create may take elsewhere (it is full, or did not
    answer), carried out of _make past the caller's other error handling:
    the row stays charged, to be moved."""

    def __init__(self, error: CorralError) -> None:
        super().__init__(error.message)
        self.error = error


class GatewayView(Forwarding, KeyOps):
    """The sandbox API for one project, served by a gateway (`grant`: its key's)."""

    def __init__(self, gateway: GatewayCore, project: str, grant: keys.Grant | None = None) -> None:
        self.gw, self.project, self.grant = gateway, project, grant

    async def start(self) -> None:
        """A view is a lens on the shared gateway, started by its owner."""

    async def commit(self, sandbox_id: str, req: CommitRequest) -> LayerInfo:
        owner = (await self._row(sandbox_id)).project
        project_images.check_commit(self.project, req, owner, sandbox_id)
        layer = await self._forward(sandbox_id, lambda node: node.commit(sandbox_id, req))
        return self.gw.note_layer(ids.parse(sandbox_id).node, layer)

    async def aclose(self) -> None:
        """A view is a lens on the shared gateway: nothing of its own to close."""

    # ------------------------------------------------------------ routing

    async def _row(self, sandbox_id: str) -> SandboxRow:
        sid = ids.parse(sandbox_id)
        row = await sandboxes.by_id(self.gw.db, sandbox_id)
        if row is None or self.project not in await self.gw.chain(row.project):
            # A forged id, another project's sandbox, or one never made: all
            # look the same, so ids cannot be probed across projects.
            known = await self.gw.node(sid.node) is not None
            where = "" if known else f": node {sid.node!r} is not a member of this cluster"
            raise SandboxNotFound(f"no sandbox {sandbox_id}{where}", sandbox=sandbox_id)
        if row.state == "lost":
            raise SandboxLost(
                f"sandbox {sandbox_id} was lost with its node {row.node}: {row.error}",
                sandbox=sandbox_id,
                node=row.node,
            )
        return row

    async def _route(self, sandbox_id: str) -> tuple[SandboxRow, SandboxService]:
        row = await self._row(sandbox_id)
        if row.node in self.gw.burst.by_name and row.remote_id:
            # On another cluster: its gateway, under the id it has there.
            client = self.gw.burst.client(row.node)
            return row, burst.Aliased(client, sandbox_id, row.remote_id).as_service()
        node = await self.gw.node(row.node)
        if row.state == "closed" and (node is None or node.state != nodes.ALIVE):
            # Its node, which would answer with the closed sandbox's info, is
            # gone (a job moved off preempted hosts closed what it moved).
            raise SandboxClosed(f"sandbox {sandbox_id} is closed", sandbox=sandbox_id)
        if node is None or node.state != nodes.ALIVE:
            raise SandboxLost(
                f"sandbox {sandbox_id} is on node {row.node}, which is "
                f"{'unknown' if node is None else node.state}",
                sandbox=sandbox_id,
                node=row.node,
            )
        return row, self.gw.client(node)

    def _lost(self, sandbox_id: str, row: SandboxRow) -> SandboxLost:
        return SandboxLost(
            f"sandbox {sandbox_id} was lost with its node {row.node}, which stopped "
            f"heartbeating for more than {self.gw.node_timeout:g} s",
            sandbox=sandbox_id,
            node=row.node,
        )

    async def _forward(self, sandbox_id: str, call: Callable[[SandboxService], Awaitable[T]]) -> T:
        row, client = await self._route(sandbox_id)
        try:
            return await self.gw.watch(row.node, call(client))
        except NodeLost as exc:
            raise self._lost(sandbox_id, row) from exc
        except SandboxNotFound:
            # The node no longer has it (TTL, idle timeout): the store agrees now.
            await sandboxes.finish(self.gw.db, row.key, "closed", "gone from its node")
            raise
        except Unavailable as exc:
            raise Unavailable(
                f"node {row.node} of sandbox {sandbox_id} is unreachable ({exc.message}); "
                f"if it stays silent for {self.gw.node_timeout:g} s its sandboxes are "
                "marked lost",
                sandbox=sandbox_id,
                node=row.node,
            ) from exc

    # ------------------------------------------------------------ charged sandboxes

    async def _reserve(
        self, keys: Sequence[str], node: str, kind: str, cpu: float, memory: int,
        owner: str | None = None,
    ) -> builtins.list[tuple[SandboxRow, bool]]:  # fmt: skip
        """The row of each key, charged to `owner` (this project unless said)
        and placed on `node` if new (True), else as found (False). All or
        none: if a charge is refused, the rows still placing are failed again."""
        db, project = self.gw.db, owner or self.project
        levels = len(await self.gw.chain(project))
        out: builtins.list[tuple[SandboxRow, bool]] = []
        try:
            for key in keys:
                out.append(
                    await sandboxes.reserve(
                        db, key, project, node, kind, cpu, memory, levels=levels
                    )
                )
        except CorralError as exc:
            for row, _new in out:
                if row.state == "placing":
                    await sandboxes.finish(db, row.key, "failed", exc.message)
            raise
        return out

    async def _make(
        self,
        rows: Sequence[SandboxRow],
        name: str,
        call: Callable[[SandboxService], Awaitable[Made]],
        *,
        movable: tuple[type[CorralError], ...] = (),
    ) -> builtins.list[SandboxInfo]:
        """Ask node `name` (`call` on its service) for the sandboxes `rows`
        were charged for, one per row in order, and record the outcome:
        each row ready with its sandbox's id; on an error, every row failed
        (its charge released), except for a `movable` error, raised as
        _Refused with the rows still charged. A row written off meanwhile
        (its node was marked lost during the call) is never resurrected:
        its sandbox is closed on the node and the caller hears SandboxLost."""
        gw = self.gw
        node = await gw.node(name)
        try:
            if node is None or node.state != nodes.ALIVE:
                raise Unavailable(f"node {name} is not alive")
            made = await gw.watch(name, call(gw.client(node)))
        except movable as exc:
            raise _Refused(exc) from exc
        except CorralError as exc:
            for row in rows:
                await sandboxes.finish(gw.db, row.key, "failed", exc.message)
            raise
        infos = made if isinstance(made, builtins.list) else [made]
        for row, info in zip(rows, infos, strict=True):
            if await sandboxes.mark_ready(gw.db, row.key, info.id) is None:
                with contextlib.suppress(CorralError):
                    await gw.client(node).close(info.id)
                now = (await sandboxes.by_keys(gw.db, [row.key])).get(row.key)
                raise SandboxLost(
                    f"sandbox {info.id} was written off while it was being created: "
                    f"its record is {now.state if now else 'gone'}"
                    + (f" ({now.error})" if now and now.error else ""),
                    sandbox=info.id,
                )
        return infos

    # ------------------------------------------------------------ create

    async def create(self, req: CreateSandbox) -> SandboxInfo:
        started = time.monotonic()
        # Placement (gateway.place) and the hop to the node are its children.
        attrs = {"corral.project": self.project, "sandbox.kind": req.kind}
        with trace.span("gateway.create", **attrs) as span:
            try:
                info, outcome = await self._create(req)
            except CorralError as exc:
                metrics.GATEWAY_CREATES.labels(exc.code).inc()
                raise
            span.set("sandbox.id", info.id)
            span.set("outcome", outcome)
        metrics.GATEWAY_CREATES.labels(outcome).inc()
        if outcome == "ready":
            metrics.GATEWAY_CREATE_SECONDS.observe(time.monotonic() - started)
        return info

    async def _create(self, req: CreateSandbox) -> tuple[SandboxInfo, str]:
        project_images.check_create(self.project, req)
        for key in req.labels:
            if key in platform_labels.RESERVED:
                raise InvalidArgument(
                    f"labels.{key}", "is reserved for the platform (set by the gateway)", key
                )
        gw = self.gw
        key = sandboxes.node_key(self.project, req.idempotency_key or secrets.token_hex(16))
        # Placement first (in memory), then one transaction that finds the
        # key's row or makes it: a retry costs no more than a first try.
        try:
            if gw.burst and await gw.busy():  # utilisation before this create
                raise ResourceExhausted(
                    f"local nodes are past the burst threshold ({gw.burst.threshold:.0%})"
                )
            first = await gw.choose(
                kind=req.kind, layers=_layers(req), memory=req.memory, cpu=req.cpu, exclude=set()
            )
        except ResourceExhausted as exc:
            found = (await sandboxes.by_keys(gw.db, [key])).get(key)
            if found is None or found.state == "failed":
                return await self._spill(req, key, exc), "burst"
            row, new = found, False  # no room now, but this key's sandbox exists
        else:
            try:
                [(row, new)] = await self._reserve([key], first.name, req.kind, req.cpu, req.memory)
            finally:
                gw.release(first.name)  # _drive holds the row's node from here
        if not new:
            if row.state == "ready" and row.id is not None:
                return await self.get(row.id), "found"
            if row.state == "lost":
                raise SandboxLost(
                    f"the sandbox made for this idempotency key was lost: {row.error}",
                    sandbox=row.id,
                )
            if row.state == "closed":
                raise Conflict(
                    f"the sandbox made for this idempotency key ({row.id}) was closed",
                    sandbox=row.id,
                )
        if row.node in gw.burst.by_name:  # a retry of a create that burst
            return await self._spill(req, key, None), "burst"
        tagged = {**req.labels, platform_labels.PROJECT: self.project, platform_labels.KEY: key}
        to_node = req.model_copy(update={"idempotency_key": key, "labels": tagged})
        try:
            return await self._drive(row, to_node), "ready"
        except ResourceExhausted as exc:
            if not gw.burst or exc.details.get("quota"):
                raise
            return await self._spill(req, key, exc), "burst"

    async def _spill(
        self, req: CreateSandbox, key: str, local: ResourceExhausted | None
    ) -> SandboxInfo:
        """To a burst target, since no local node can take it (`local` says why)."""
        if not self.gw.burst:
            assert local is not None
            raise local
        try:
            return await spill.create(self.gw, self._reserve, self.get, req, key)
        except burst.BurstRefused as refused:
            here = local.message if local is not None else "local nodes"
            raise ResourceExhausted(
                f"{here}; and no burst target took it: {refused}", kind=req.kind
            ) from None

    async def _drive(self, row: SandboxRow, req: CreateSandbox) -> SandboxInfo:
        """Ask the row's node; when it is full or unreachable, move the row
        to another node and ask that one. Any other error fails the row. The
        node being asked is counted in flight (placement sees it) throughout."""
        gw = self.gw
        name, refused = row.node, set[str]()
        gw.hold(name)
        try:
            while True:
                try:
                    [info] = await self._make(
                        [row], name, lambda node: node.create(req), movable=(NodeFull, Unavailable)
                    )
                    return info
                except _Refused as refusal:
                    exc = refusal.error
                refused.add(name)
                log.info("create.retry_elsewhere", node=name, reason=exc.message)
                why = "full" if isinstance(exc, NodeFull) else "unreachable"
                metrics.GATEWAY_ELSEWHERE.labels(why).inc()
                try:
                    nxt = await gw.choose(
                        kind=req.kind,
                        layers=_layers(req),
                        memory=req.memory,
                        cpu=req.cpu,
                        exclude=refused,
                    )
                except ResourceExhausted:
                    await sandboxes.finish(gw.db, row.key, "failed", exc.message)
                    raise
                gw.release(name)
                name = nxt.name  # held by choose()
                row = await self._relocate(row, name, exc)
        finally:
            gw.release(name)

    async def _relocate(self, row: SandboxRow, node: str, why: CorralError) -> SandboxRow:
        """Move a create to `node`: a placing row moves (only from where
        this request left it); a row the sweep failed because its node was
        lost mid-create is charged and placed again."""
        db = self.gw.db
        if await sandboxes.move(db, row.key, row.node, node):
            return replace(row, node=node)
        current = (await sandboxes.by_keys(db, [row.key])).get(row.key)
        if current is not None and current.state == "failed":
            moved, _ = await sandboxes.reserve(
                db, row.key, row.project, node, row.kind, row.cpu, row.memory
            )
            return moved
        raise Conflict(
            "another request is creating the sandbox for this idempotency key: "
            "retry with the same key to get it",
        ) from why

    # ------------------------------------------------------------ the rest

    async def list(self, labels: dict[str, str] | None = None) -> builtins.list[SandboxInfo]:
        """This project's live sandboxes (not its sub-projects'), from their nodes."""
        wanted = {**(labels or {}), platform_labels.PROJECT: self.project}
        out: builtins.list[SandboxInfo] = []
        for found in await self._everywhere("list", lambda node: node.list(wanted)):
            out += found
        for target in self.gw.burst.by_name:
            out += await self._listed_on(target, labels or {})
        return sorted(out, key=lambda s: s.created_at)

    async def _listed_on(self, target: str, labels: dict[str, str]) -> builtins.list[SandboxInfo]:
        """This project's sandboxes on a burst target, under their home ids
        (the target's project is shared by every home project that bursts)."""
        rows = await sandboxes.ready_on(self.gw.db, target, self.project)
        mine = {r.remote_id: r.id for r in rows}
        if not mine:
            return []
        try:
            theirs = await self.gw.burst.client(target).list(labels or None)
        except CorralError as exc:
            log.warning("list.burst_failed", target=target, error=exc.message)
            return []
        return [s.model_copy(update={"id": mine[s.id]}) for s in theirs if mine.get(s.id)]

    async def _everywhere(
        self, what: str, call: Callable[[SandboxService], Awaitable[T]]
    ) -> builtins.list[T]:
        """`call` on every live node at once; a node that fails is logged
        and left out (the others' answers still count)."""
        alive = [n for n in await self.gw.nodes() if n.state == nodes.ALIVE]
        found = await asyncio.gather(
            *(self.gw.watch(n.name, call(self.gw.client(n))) for n in alive),
            return_exceptions=True,
        )
        out: builtins.list[T] = []
        for n, result in zip(alive, found, strict=True):
            if isinstance(result, BaseException):
                log.warning(f"{what}.node_failed", node=n.name, error=str(result))
                continue
            out.append(result)
        return out

    async def close(self, sandbox_id: str) -> None:
        try:
            row = await self._row(sandbox_id)
        except SandboxLost:
            lost = await sandboxes.by_id(self.gw.db, sandbox_id)
            if lost is not None:
                await sandboxes.finish(self.gw.db, lost.key, "closed")
            return
        if row.node in self.gw.burst.by_name:
            _row, service = await self._route(sandbox_id)
            with contextlib.suppress(SandboxNotFound):
                await service.close(sandbox_id)
            await sandboxes.finish(self.gw.db, row.key, "closed")
            return
        node = await self.gw.node(row.node)
        if node is not None and node.state == nodes.ALIVE:
            # Lost meanwhile: closing acknowledges the loss; the node closes
            # the sandbox itself if it ever comes back (reconcile).
            with contextlib.suppress(SandboxNotFound, NodeLost):
                await self.gw.watch(node.name, self.gw.client(node).close(sandbox_id))
        await sandboxes.finish(self.gw.db, row.key, "closed")

    async def exec(self, sandbox_id: str, req: ExecRequest) -> AsyncIterator[ExecEvent]:
        row, client = await self._route(sandbox_id)
        # The stream is read by one task (httpx's stream must open and close
        # in the task that reads it); this generator waits on its queue,
        # watching the node, so a node lost mid-command ends the stream.
        queue: asyncio.Queue[ExecEvent | CorralError | None] = asyncio.Queue(maxsize=64)

        async def pump() -> None:
            try:
                async for event in client.exec(sandbox_id, req):
                    await queue.put(event)
                await queue.put(None)
            except Exception as exc:
                await queue.put(
                    exc if isinstance(exc, CorralError) else InternalError(f"exec stream: {exc}")
                )

        reader = asyncio.create_task(pump())
        try:
            while True:
                try:
                    item = await self.gw.watch(row.node, queue.get())
                except NodeLost as exc:
                    raise self._lost(sandbox_id, row) from exc
                if item is None:
                    return
                if isinstance(item, CorralError):
                    raise item
                yield item
        finally:
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader

    async def restore(self, req: SavedState) -> SandboxInfo:
        """Placed and charged like a create (by the size save() returned,
        which the node checks against the signed record), then the node
        loads the state from the named store."""
        if req.kind not in (*VM_KINDS, "container"):
            raise InvalidArgument(
                "kind", "must be a kind a state is saved from (container, microvm, fullvm)",
                req.kind,
            )  # fmt: skip
        if req.project != self.project:
            # A saved state is restored only by the project that saved it;
            # the gateway never opens a store itself (the node does, one the
            # operator named, and checks the signed record's project).
            raise InvalidArgument("key", "names no saved state of this project", req.key)
        if not req.memory or not req.cpu:
            raise InvalidArgument(
                "memory", "must be the saved size: pass the SavedState that save() returned",
                req.memory,
            )  # fmt: skip
        gw = self.gw
        key = sandboxes.node_key(self.project, req.idempotency_key or secrets.token_hex(16))
        cpu, memory = req.cpu, req.memory
        node = await gw.choose(kind=req.kind, layers=(), memory=memory, exclude=set())
        try:
            [(row, new)] = await self._reserve([key], node.name, req.kind, cpu, memory)
        finally:
            gw.release(node.name)
        if not new and row.state == "ready" and row.id is not None:
            return await self.get(row.id)
        to_node = req.model_copy(update={"idempotency_key": key})
        [info] = await self._make([row], row.node, lambda node: node.restore(to_node))
        return info

    async def fork(self, sandbox_id: str, req: ForkRequest) -> builtins.list[SandboxInfo]:
        """Copies live on the source's node (they load its saved memory), so
        there is no placement: n rows on that node, charged to this project
        like creates, then the node's fork with a key per row."""
        source, _ = await self._route(sandbox_id)
        if source.node in self.gw.burst.by_name:
            raise InvalidArgument(
                "sandbox_id", f"is on burst target {source.node}: fork is offered for sandboxes "
                "on this cluster's own nodes", sandbox_id,
            )  # fmt: skip
        given = req.idempotency_keys or [secrets.token_hex(16) for _ in range(req.n)]
        # The source's project's, as their copied labels say (a project above may ask).
        keys = [sandboxes.node_key(source.project, k) for k in given]
        reserved = await self._reserve(
            keys, source.node, source.kind, source.cpu, source.memory, source.project
        )
        rows = [row for row, _new in reserved]
        if all(row.state == "ready" and row.id for row in rows):  # a retry: made already
            return [await self.get(row.id) for row in rows if row.id]
        to_node = ForkRequest(n=req.n, idempotency_keys=keys)
        return await self._make(rows, source.node, lambda node: node.fork(sandbox_id, to_node))

    async def direct(self, sandbox_id: str, ttl: int = 300) -> DirectAccess:
        """A token the sandbox's node checks by itself (api/direct.py)."""
        ttl = self._within_key(direct.check_ttl(ttl))
        row, _ = await self._route(sandbox_id)  # ownership, and its node alive
        if row.node in self.gw.burst.by_name and row.remote_id:
            # Its node is the target's: that gateway issues the path, for
            # the id the sandbox has there.
            return await self.gw.burst.client(row.node).direct(row.remote_id, ttl)
        node = await self.gw.node(row.node)
        if self.gw.node_key is None or node is None:
            raise Unavailable("this gateway's nodes have no key: it cannot sign a direct path")
        token, expires = direct.issue(self.gw.node_key, sandbox_id, node.name, ttl)
        metrics.GATEWAY_DIRECT.inc()
        return DirectAccess(sandbox_id=sandbox_id, url=node.url, token=token, expires_at=expires)

    async def rollout_steps(self, rollout: str) -> builtins.list[RolloutStep]:
        return await self.gw.steplog.steps(self.project, rollout)

    async def rollout_append(self, rollout: str, step: RolloutStep) -> None:
        await self.gw.steplog.append(self.project, rollout, step)

    async def rollout_delete(self, rollout: str) -> None:
        await self.gw.steplog.delete(self.project, rollout)

    async def rollout_report(self, rollout: str) -> RolloutReport:
        """From every live node, this project's sandboxes of the rollout."""
        mine: builtins.list[AuditReport] = []
        answers = await self._everywhere("rollout_report", lambda n: n.rollout_report(rollout))
        for result in answers:
            for sid in result.sandboxes:
                with contextlib.suppress(CorralError):
                    await self._row(sid)  # another project's: not ours to see
                    findings = [f for f in result.findings if f.sandbox == sid]
                    mine.append(
                        AuditReport(sandbox=sid, findings=findings, verdict=verdict.worst(findings))
                    )
        return verdict.rollout_report(rollout, mine)

    def events(self, labels: dict[str, str] | None = None) -> AsyncIterator[Event]:
        wanted = {**(labels or {}), platform_labels.PROJECT: self.project}
        return self._rechecked(self._events(wanted))

    async def _events(self, wanted: dict[str, str]) -> AsyncIterator[Event]:
        alive = {n.name: self.gw.client(n) for n in await self.gw.nodes() if n.state == nodes.ALIVE}
        async for event in merged_events(alive, wanted):
            yield event

    async def list_layers(self, labels: dict[str, str] | None = None) -> builtins.list[LayerInfo]:
        return await project_layers.listed(self.gw, self.project, labels)

    async def delete_layer(self, ref: str) -> None:
        await project_layers.delete(self.gw, self.project, ref, await self.list())

    async def run_call(self, req: FnCallRequest) -> FnCallResult:
        """Stateless: any node with function-call workers; full or
        unreachable nodes are skipped."""
        req = project_images.check_call(self.project, req)
        refused: set[str] = set()
        while True:
            node = await self.gw.choose(kind="fncall", layers=(), memory=0, exclude=refused)
            try:
                return await self.gw.client(node).run_call(req)
            except (NodeFull, Unavailable):
                refused.add(node.name)
            finally:
                self.gw.release(node.name)


def _layers(req: CreateSandbox) -> builtins.list[str]:
    """The references a create's root is made of, base first."""
    return [req.image, *([req.workspace] if req.workspace else []), *req.toolkit]
