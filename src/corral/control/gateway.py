"""The gateway: the sandbox API in front of many node agents.

Stateless by construction: everything it knows about a sandbox is a row in
the state store (sandboxes.py), written before a node is asked, so any
replica can serve any request and a killed replica loses nothing. What it
does keep in memory is per node, not per sandbox: a membership snapshot at
most `view_ttl` old, an HTTP connection pool, and how many creates it has in
flight to each node (placement subtracts them from stale capacity).

A sandbox id is ``<node>-<16 hex>``: the gateway checks the row (the
caller's project must own it, or be an ancestor of its owner) and sends the
request to that node agent's own HTTP endpoint. Ray is never on this path.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

from corral import metrics
from corral.api.models import (
    VM_KINDS,
    AuditReport,
    CommitRequest,
    CreateSandbox,
    DisplayInput,
    ExecEvent,
    ExecRequest,
    FileEntry,
    FnCallRequest,
    FnCallResult,
    ForkRequest,
    LayerInfo,
    NetworkPolicy,
    SandboxInfo,
    SavedState,
    SaveRequest,
)
from corral.api.service import SandboxService
from corral.control import nodes, placement, quotas, sandboxes
from corral.control.db import Database
from corral.control.nodes import NodeRow
from corral.control.sandboxes import SandboxRow
from corral.control.schema import migrate
from corral.errors import (
    Conflict,
    CorralError,
    InternalError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SandboxLost,
    SandboxNotFound,
    Unavailable,
)
from corral.log import get_logger
from corral.sdk.http import HttpService

log = get_logger("corral.gateway")

PROJECT_LABEL = "corral.project"
KEY_LABEL = "corral.key"
RESERVED_LABELS = (PROJECT_LABEL, KEY_LABEL, "corral.pool")
_ID = re.compile(r"([a-z0-9]{1,16})-[0-9a-f]{16}")
# A create a gateway abandoned (it died) is adopted or failed by the sweep
# once it is this old.
STALE_PLACING = 300.0
T = TypeVar("T")


def _saved_spec(req: SavedState) -> dict[str, Any]:
    """The record a saved state was saved with (its size, for the charge)."""
    from corral.images.objects import open_store

    try:
        doc: dict[str, Any] = json.loads(open_store(req.store).get(f"{req.key}/saved.json"))
    except NotFound:
        raise InvalidArgument("key", "names no saved state in the store", req.key) from None
    return doc


class NodeLost(Unavailable):
    """A request's node was written off while the request was in flight."""

    def __init__(self, node: str, state: str) -> None:
        super().__init__(f"node {node} is {state}", node=node)
        self.node = node


class Gateway:
    def __init__(
        self,
        db: Database,
        *,
        node_key: str | None,
        node_timeout: float = 10.0,
        sweep_interval: float = 1.0,
        view_ttl: float = 0.5,
        k: int = placement.K,
    ) -> None:
        self.db = db
        self.node_key = node_key
        self.node_timeout = node_timeout
        self.sweep_interval = sweep_interval
        self.view_ttl = view_ttl
        self.k = k
        self._view: tuple[float, list[NodeRow]] = (0.0, [])
        self._clients: dict[tuple[str, str], HttpService] = {}
        self.in_flight: dict[str, int] = {}
        self._keys: dict[str, tuple[float, str]] = {}
        self._chains: dict[str, tuple[float, list[str]]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._reconciling: asyncio.Task[None] | None = None
        self._mismatch: dict[str, int] = {}

    async def start(self, *, sweep: bool = True) -> Gateway:
        await migrate(self.db)
        if sweep:
            self._sweeper = asyncio.create_task(self._sweep_loop())
        return self

    async def aclose(self) -> None:
        for task in (self._sweeper, self._reconciling):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()

    # ------------------------------------------------------------ callers

    async def for_token(self, token: str) -> SandboxService:
        """The API as seen by the project that owns API key `token`."""
        now = time.monotonic()
        cached = self._keys.get(token)
        if cached is not None and now - cached[0] < 5.0:
            return GatewayView(self, cached[1])
        if not token:
            from corral.errors import Unauthenticated

            raise Unauthenticated("a valid API key is required: Authorization: Bearer <key>")
        project = await quotas.project_of_key(self.db, token)
        self._keys[token] = (now, project)
        return GatewayView(self, project)

    async def chain(self, project: str) -> list[str]:
        """`project` and its ancestors (cached briefly: projects rarely move)."""
        now = time.monotonic()
        cached = self._chains.get(project)
        if cached is not None and now - cached[0] < 5.0:
            return cached[1]
        async with self.db.transaction() as tx:
            names = await quotas.ancestors(tx, project)
        self._chains[project] = (now, names)
        return names

    # ------------------------------------------------------------ nodes

    async def nodes(self, *, fresh: bool = False) -> list[NodeRow]:
        at, rows = self._view
        if fresh or time.monotonic() - at > self.view_ttl:
            rows = await nodes.list_nodes(self.db)
            self._view = (time.monotonic(), rows)
            for state in (nodes.ALIVE, nodes.LOST, nodes.LEFT):
                metrics.GATEWAY_NODES.labels(state).set(sum(n.state == state for n in rows))
        return rows

    async def node(self, name: str) -> NodeRow | None:
        for n in await self.nodes():
            if n.name == name:
                return n
        return next((n for n in await self.nodes(fresh=True) if n.name == name), None)

    def client(self, node: NodeRow) -> HttpService:
        key = (node.name, node.url)
        if key not in self._clients:
            self._clients[key] = HttpService(node.url, api_key=self.node_key)
        return self._clients[key]

    async def choose(
        self, *, kind: str, image: str | None, memory: int, exclude: set[str]
    ) -> NodeRow:
        """A node for one sandbox, counted in flight to it until release():
        the count is taken in the same step as the choice (no await between),
        so a burst of concurrent creates sees each other's picks."""
        node = placement.choose(
            await self.nodes(),
            kind=kind,
            image=image,
            memory=memory,
            in_flight=self.in_flight,
            exclude=exclude,
            k=self.k,
        )
        self.hold(node.name)
        return node

    def hold(self, name: str) -> None:
        self.in_flight[name] = self.in_flight.get(name, 0) + 1

    def release(self, name: str) -> None:
        left = self.in_flight.get(name, 0) - 1
        if left > 0:
            self.in_flight[name] = left
        else:
            self.in_flight.pop(name, None)

    async def watch(self, name: str, request: Awaitable[T]) -> T:
        """`request` to node `name`, abandoned if the node is marked lost
        meanwhile: a stopped node accepts connections and never answers, so
        without this a caller would wait out the HTTP timeout instead of the
        loss bound (node_timeout + a sweep)."""
        task = asyncio.ensure_future(request)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.sweep_interval)
                if done:
                    return task.result()
                node = await self.node(name)
                if node is None or node.state != nodes.ALIVE:
                    raise NodeLost(name, "unknown" if node is None else node.state)
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    # ------------------------------------------------------------ sweep

    async def _sweep_loop(self) -> None:
        reachable_since: float | None = None
        while True:
            await asyncio.sleep(self.sweep_interval)
            try:
                if reachable_since is None:
                    await nodes.list_nodes(self.db)
                    reachable_since = time.monotonic()
                # Silence is judged only after a full timeout of reaching the
                # store: nodes could not heartbeat while it was down either.
                if time.monotonic() - reachable_since >= self.node_timeout:
                    for name in await nodes.sweep_lost(self.db, self.node_timeout):
                        log.warning("node.lost", node=name, timeout=self.node_timeout)
                        metrics.GATEWAY_NODES_LOST.inc()
                # Reconciling talks to nodes, and a node may hang: it runs
                # beside the sweep, never in its way.
                if self._reconciling is None or self._reconciling.done():
                    self._reconciling = asyncio.create_task(self.reconcile_all())
            except Unavailable as exc:
                if reachable_since is not None:
                    log.warning("gateway.store_unavailable", error=str(exc))
                reachable_since = None
            except Exception as exc:
                log.error("gateway.sweep_failed", exc=True, error=str(exc))

    async def reconcile_all(self) -> None:
        """Reconcile a node whose count of gateway sandboxes disagrees with
        the store's twice in a row (once may be a create in flight)."""
        for n in await self.nodes(fresh=True):
            if n.state != nodes.ALIVE:
                continue
            held = int(n.capacity.get("held", 0))
            if held == await sandboxes.count_on_node(self.db, n.name):
                self._mismatch.pop(n.name, None)
                continue
            self._mismatch[n.name] = self._mismatch.get(n.name, 0) + 1
            if self._mismatch[n.name] >= 2:
                self._mismatch.pop(n.name, None)
                try:
                    await asyncio.wait_for(self.reconcile(n), timeout=max(self.node_timeout, 5.0))
                except (CorralError, TimeoutError) as exc:
                    log.warning("node.reconcile_failed", node=n.name, error=str(exc))

    async def reconcile(self, node: NodeRow) -> dict[str, int]:
        """Make `node` and the store agree about the sandboxes gateways made:
        - on the node, no row or a written-off one (lost, closed, failed,
          placed elsewhere): closed on the node (a lost node came back);
        - a placing row whose sandbox the node has: adopted (ready);
        - a ready row the node no longer has (TTL, idle timeout, failure):
          closed in the store, its quota released;
        - a placing row older than STALE_PLACING the node never made: failed.
        """
        client = self.client(node)
        held = [s for s in await client.list() if KEY_LABEL in s.labels]
        rows = await sandboxes.by_keys(self.db, [s.labels[KEY_LABEL] for s in held])
        out = {"closed_on_node": 0, "adopted": 0, "closed_in_store": 0, "failed": 0}
        seen: set[str] = set()
        for s in held:
            key = s.labels[KEY_LABEL]
            row = rows.get(key)
            if row is None or row.node != node.name or row.state not in sandboxes.CHARGED:
                with contextlib.suppress(CorralError):
                    await client.close(s.id)
                out["closed_on_node"] += 1
                continue
            seen.add(key)
            stale = row.state == "placing" and row.age > STALE_PLACING
            if (
                stale
                and s.state.value == "running"
                and await sandboxes.mark_ready(self.db, key, s.id)
            ):
                out["adopted"] += 1
        for row in await sandboxes.on_node(self.db, node.name):
            if row.key in seen:
                continue
            # Young rows may be creates still in flight.
            if row.state == "ready" and row.age > 5.0:
                closed = await sandboxes.finish(self.db, row.key, "closed", "gone from its node")
                out["closed_in_store"] += closed
            elif row.state == "placing" and row.age > STALE_PLACING:
                failed = await sandboxes.finish(self.db, row.key, "failed", "abandoned create")
                out["failed"] += failed
        if any(out.values()):
            log.info("node.reconciled", node=node.name, **out)
            for action, n in out.items():
                metrics.GATEWAY_RECONCILED.labels(action).inc(n)
        return out


class GatewayView:
    """The sandbox API for one project, served by a Gateway."""

    def __init__(self, gateway: Gateway, project: str) -> None:
        self.gw = gateway
        self.project = project

    # ------------------------------------------------------------ routing

    async def _row(self, sandbox_id: str) -> SandboxRow:
        m = _ID.fullmatch(sandbox_id)
        if m is None:
            raise InvalidArgument("sandbox_id", "must be <node>-<16 hex digits>", sandbox_id)
        row = await sandboxes.by_id(self.gw.db, sandbox_id)
        if row is None or self.project not in await self.gw.chain(row.project):
            # A forged id, another project's sandbox, or one never made: all
            # look the same, so ids cannot be probed across projects.
            known = await self.gw.node(m.group(1)) is not None
            where = "" if known else f": node {m.group(1)!r} is not a member of this cluster"
            raise SandboxNotFound(f"no sandbox {sandbox_id}{where}", sandbox=sandbox_id)
        if row.state == "lost":
            raise SandboxLost(
                f"sandbox {sandbox_id} was lost with its node {row.node}: {row.error}",
                sandbox=sandbox_id,
                node=row.node,
            )
        return row

    async def _route(self, sandbox_id: str) -> tuple[SandboxRow, HttpService]:
        row = await self._row(sandbox_id)
        node = await self.gw.node(row.node)
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

    async def _forward(self, sandbox_id: str, call: Callable[[HttpService], Any]) -> Any:
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

    # ------------------------------------------------------------ create

    async def create(self, req: CreateSandbox) -> SandboxInfo:
        started = time.monotonic()
        try:
            info, outcome = await self._create(req)
        except CorralError as exc:
            metrics.GATEWAY_CREATES.labels(exc.code).inc()
            raise
        metrics.GATEWAY_CREATES.labels(outcome).inc()
        if outcome == "ready":
            metrics.GATEWAY_CREATE_SECONDS.observe(time.monotonic() - started)
        return info

    async def _create(self, req: CreateSandbox) -> tuple[SandboxInfo, str]:
        for key in req.labels:
            if key in RESERVED_LABELS:
                raise InvalidArgument(
                    f"labels.{key}", "is reserved for the platform (set by the gateway)", key
                )
        gw = self.gw
        key = sandboxes.node_key(self.project, req.idempotency_key or secrets.token_hex(16))
        # Placement first (in memory), then one transaction that finds the
        # key's row or makes it: a retry costs no more than a first try.
        try:
            first = await gw.choose(
                kind=req.kind, image=req.image, memory=req.memory, exclude=set()
            )
        except ResourceExhausted:
            found = (await sandboxes.by_keys(gw.db, [key])).get(key)
            if found is None or found.state == "failed":
                raise
            row, new = found, False  # no room now, but this key's sandbox exists
        else:
            try:
                levels = len(await gw.chain(self.project))
                row, new = await sandboxes.reserve(
                    gw.db, key, self.project, first.name, req.kind, req.cpu, req.memory,
                    levels=levels,
                )  # fmt: skip
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
        labels = {**req.labels, PROJECT_LABEL: self.project, KEY_LABEL: key}
        to_node = req.model_copy(update={"idempotency_key": key, "labels": labels})
        return await self._drive(row, to_node), "ready"

    async def _drive(self, row: SandboxRow, req: CreateSandbox) -> SandboxInfo:
        """Ask the row's node; on "full" or "unreachable" move the row to
        another node and ask it. Any other error fails the row. The node
        being asked is counted in flight (placement sees it) throughout."""
        gw = self.gw
        name, refused = row.node, set[str]()
        gw.hold(name)
        try:
            while True:
                node = await gw.node(name)
                try:
                    if node is None or node.state != nodes.ALIVE:
                        raise Unavailable(f"node {name} is not alive")
                    info = await gw.watch(name, gw.client(node).create(req))
                except (ResourceExhausted, Unavailable) as exc:
                    if isinstance(exc, ResourceExhausted) and "node" not in exc.details:
                        await sandboxes.finish(gw.db, row.key, "failed", exc.message)
                        raise
                    refused.add(name)
                    log.info("create.retry_elsewhere", node=name, reason=exc.message)
                    metrics.GATEWAY_ELSEWHERE.labels(
                        "full" if isinstance(exc, ResourceExhausted) else "unreachable"
                    ).inc()
                    try:
                        nxt = await gw.choose(
                            kind=req.kind, image=req.image, memory=req.memory, exclude=refused
                        )
                    except ResourceExhausted:
                        await sandboxes.finish(gw.db, row.key, "failed", exc.message)
                        raise
                    gw.release(name)
                    name = nxt.name  # held by choose()
                    row = await self._relocate(row, name, exc)
                    continue
                except CorralError as exc:
                    await sandboxes.finish(gw.db, row.key, "failed", exc.message)
                    raise
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
                return info
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

    async def get(self, sandbox_id: str) -> SandboxInfo:
        info: SandboxInfo = await self._forward(sandbox_id, lambda c: c.get(sandbox_id))
        return info

    async def list(self, labels: dict[str, str] | None = None) -> builtins.list[SandboxInfo]:
        """This project's live sandboxes (not its sub-projects'), from their nodes."""
        wanted = {**(labels or {}), PROJECT_LABEL: self.project}
        alive = [n for n in await self.gw.nodes() if n.state == nodes.ALIVE]
        found = await asyncio.gather(
            *(self.gw.watch(n.name, self.gw.client(n).list(wanted)) for n in alive),
            return_exceptions=True,
        )
        out: builtins.list[SandboxInfo] = []
        for n, result in zip(alive, found, strict=True):
            if isinstance(result, BaseException):
                log.warning("list.node_failed", node=n.name, error=str(result))
                continue
            out += result
        return sorted(out, key=lambda s: s.created_at)

    async def close(self, sandbox_id: str) -> None:
        try:
            row = await self._row(sandbox_id)
        except SandboxLost:
            lost = await sandboxes.by_id(self.gw.db, sandbox_id)
            if lost is not None:
                await sandboxes.finish(self.gw.db, lost.key, "closed")
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

    async def kill(self, sandbox_id: str, pid: int, signal: int = 9) -> None:
        await self._forward(sandbox_id, lambda c: c.kill(sandbox_id, pid, signal))

    async def read_file(self, sandbox_id: str, path: str, user: str = "root") -> bytes:
        data: bytes = await self._forward(sandbox_id, lambda c: c.read_file(sandbox_id, path, user))
        return data

    async def write_file(
        self, sandbox_id: str, path: str, data: bytes, user: str = "root", mode: int = 0o644
    ) -> int:
        n: int = await self._forward(
            sandbox_id, lambda c: c.write_file(sandbox_id, path, data, user, mode)
        )
        return n

    async def list_files(
        self, sandbox_id: str, path: str, user: str = "root"
    ) -> builtins.list[FileEntry]:
        entries: builtins.list[FileEntry] = await self._forward(
            sandbox_id, lambda c: c.list_files(sandbox_id, path, user)
        )
        return entries

    async def stat_file(self, sandbox_id: str, path: str, user: str = "root") -> FileEntry:
        entry: FileEntry = await self._forward(
            sandbox_id, lambda c: c.stat_file(sandbox_id, path, user)
        )
        return entry

    async def make_dir(self, sandbox_id: str, path: str, user: str = "root") -> None:
        await self._forward(sandbox_id, lambda c: c.make_dir(sandbox_id, path, user))

    async def remove_file(
        self, sandbox_id: str, path: str, user: str = "root", recursive: bool = True
    ) -> None:
        await self._forward(sandbox_id, lambda c: c.remove_file(sandbox_id, path, user, recursive))

    async def upload_tar(self, sandbox_id: str, path: str, data: bytes) -> None:
        await self._forward(sandbox_id, lambda c: c.upload_tar(sandbox_id, path, data))

    async def download_tar(self, sandbox_id: str, path: str) -> bytes:
        data: bytes = await self._forward(sandbox_id, lambda c: c.download_tar(sandbox_id, path))
        return data

    async def commit(self, sandbox_id: str, req: CommitRequest) -> LayerInfo:
        layer: LayerInfo = await self._forward(sandbox_id, lambda c: c.commit(sandbox_id, req))
        return layer

    async def suspend(self, sandbox_id: str) -> SandboxInfo:
        info: SandboxInfo = await self._forward(sandbox_id, lambda c: c.suspend(sandbox_id))
        return info

    async def save(self, sandbox_id: str, req: SaveRequest) -> SavedState:
        saved: SavedState = await self._forward(sandbox_id, lambda c: c.save(sandbox_id, req))
        return saved

    async def restore(self, req: SavedState) -> SandboxInfo:
        """Placed and charged like a create (any node that runs the kind and
        reaches the store), then the node loads the state."""
        if req.kind not in VM_KINDS:
            raise InvalidArgument("kind", "must be a VM kind a state was saved from", req.kind)
        gw = self.gw
        key = sandboxes.node_key(self.project, req.idempotency_key or secrets.token_hex(16))
        doc = await asyncio.to_thread(_saved_spec, req)
        cpu, memory = float(doc["spec"]["cpu"]), int(doc["spec"]["memory"])
        node = await gw.choose(kind=req.kind, image="", memory=memory, exclude=set())
        try:
            levels = len(await gw.chain(self.project))
            row, new = await sandboxes.reserve(
                gw.db, key, self.project, node.name, req.kind, cpu, memory, levels=levels
            )
        finally:
            gw.release(node.name)
        if not new and row.state == "ready" and row.id is not None:
            return await self.get(row.id)
        target = await gw.node(row.node)
        if target is None:
            raise Unavailable(f"node {row.node} is gone")
        to_node = req.model_copy(update={"idempotency_key": key})
        try:
            info: SandboxInfo = await gw.watch(target.name, gw.client(target).restore(to_node))
        except CorralError as exc:
            await sandboxes.finish(gw.db, key, "failed", exc.message)
            raise
        await sandboxes.mark_ready(gw.db, key, info.id)
        return info

    async def fork(self, sandbox_id: str, req: ForkRequest) -> builtins.list[SandboxInfo]:
        """Copies live on the source's node (they load its saved memory), so
        there is no placement: n rows on that node, charged to this project
        like creates, then the node's fork with a key per row."""
        source, client = await self._route(sandbox_id)
        gw = self.gw
        given = req.idempotency_keys or [secrets.token_hex(16) for _ in range(req.n)]
        keys = [sandboxes.node_key(self.project, k) for k in given]
        levels = len(await gw.chain(self.project))
        rows: builtins.list[SandboxRow] = []
        try:
            for key in keys:
                row, _new = await sandboxes.reserve(
                    gw.db, key, self.project, source.node, source.kind, source.cpu,
                    source.memory, levels=levels,
                )  # fmt: skip
                rows.append(row)
        except CorralError as exc:
            for row in rows:
                if row.state == "placing":
                    await sandboxes.finish(gw.db, row.key, "failed", exc.message)
            raise
        if all(row.state == "ready" and row.id for row in rows):  # a retry: made already
            return [await self.get(row.id) for row in rows if row.id]
        to_node = ForkRequest(n=req.n, idempotency_keys=keys)
        try:
            infos = await gw.watch(source.node, client.fork(sandbox_id, to_node))
        except CorralError as exc:
            for row in rows:
                await sandboxes.finish(gw.db, row.key, "failed", exc.message)
            raise
        for row, info in zip(rows, infos, strict=True):
            await sandboxes.mark_ready(gw.db, row.key, info.id)
        return infos

    async def screenshot(self, sandbox_id: str) -> bytes:
        data: bytes = await self._forward(sandbox_id, lambda c: c.screenshot(sandbox_id))
        return data

    async def display_input(self, sandbox_id: str, req: DisplayInput) -> None:
        await self._forward(sandbox_id, lambda c: c.display_input(sandbox_id, req))

    async def resume(self, sandbox_id: str) -> SandboxInfo:
        info: SandboxInfo = await self._forward(sandbox_id, lambda c: c.resume(sandbox_id))
        return info

    async def audit(self, sandbox_id: str) -> AuditReport:
        report: AuditReport = await self._forward(sandbox_id, lambda c: c.audit(sandbox_id))
        return report

    async def update_network(self, sandbox_id: str, policy: NetworkPolicy) -> SandboxInfo:
        info: SandboxInfo = await self._forward(
            sandbox_id, lambda c: c.update_network(sandbox_id, policy)
        )
        return info

    async def run_call(self, req: FnCallRequest) -> FnCallResult:
        """Stateless: any node with function-call workers; "full" or
        unreachable nodes are skipped."""
        refused: set[str] = set()
        while True:
            node = await self.gw.choose(kind="fncall", image=None, memory=0, exclude=refused)
            try:
                return await self.gw.client(node).run_call(req)
            except (ResourceExhausted, Unavailable) as exc:
                if isinstance(exc, ResourceExhausted) and "node" not in exc.details:
                    raise
                refused.add(node.name)
            finally:
                self.gw.release(node.name)

    async def aclose(self) -> None:
        """A view is a lens on the shared gateway: nothing of its own to close."""
