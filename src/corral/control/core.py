"""What every caller's view of a gateway shares, and all a view needs of it.

Stateless by construction: everything a gateway knows about a sandbox is a
row in the state store (sandboxes.py), written before a node is asked, so
any replica can serve any request and a killed replica loses nothing. What
it keeps in memory is per node, not per sandbox: a membership snapshot at
most `view_ttl` old, an HTTP connection pool, and how many creates it has
in flight to each node (placement subtracts them from stale capacity).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from corral import metrics, trace
from corral.api.http import HttpService
from corral.api.models import LayerInfo
from corral.control import keys, nodes, placement, quotas
from corral.control.burst import DEFAULT_THRESHOLD, Targets, utilisation
from corral.control.nodes import NodeRow
from corral.db import Database
from corral.errors import ResourceExhausted, Unavailable
from corral.images.layer import STACK
from corral.node.steplog import StepLog

T = TypeVar("T")
# Seconds a layer made through this gateway is placed on before its node's
# heartbeat (every second) must have reported it.
NOTED_FOR = 10.0


class NodeLost(Unavailable):
    """A request's node was written off while the request was in flight."""

    def __init__(self, node: str, state: str) -> None:
        super().__init__(f"node {node} is {state}", node=node)
        self.node = node


class GatewayCore:
    def __init__(
        self,
        db: Database,
        *,
        node_key: str | None,
        node_timeout: float = 10.0,
        sweep_interval: float = 1.0,
        view_ttl: float = 0.5,
        k: int = placement.K,
        burst: Targets | None = None,
    ) -> None:
        self.db = db
        self.burst = burst or Targets([], DEFAULT_THRESHOLD)
        self.steplog = StepLog(db)  # rollout logs, by project
        self.node_key = node_key
        self.node_timeout = node_timeout
        self.sweep_interval = sweep_interval
        self.view_ttl = view_ttl
        self.k = k
        self._view: tuple[float, list[NodeRow]] = (0.0, [])
        self._reading: asyncio.Future[list[NodeRow]] | None = None
        self.inventory = placement.Inventory([])
        self._clients: dict[tuple[str, str], HttpService] = {}
        self.in_flight: dict[str, int] = {}
        self._chains: dict[str, tuple[float, list[str]]] = {}
        # API keys seen (by hash: no key is held), and when each was last
        # checked (control/gateway.py); at most KEYS_SEEN, oldest out first.
        self.keys_seen: dict[str, tuple[float, keys.Grant]] = {}
        self._noted: list[tuple[float, str, LayerInfo]] = []

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()
        await self.burst.aclose()

    def forget_key(self, key_id: str) -> None:
        """A key revoked through this gateway stops here at once (others
        re-check theirs within keys.RECHECK)."""
        for h in [h for h in self.keys_seen if h.startswith(key_id)]:
            del self.keys_seen[h]

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
        if fresh:  # a read begun after this call (a node that just joined)
            return await self._read_nodes()
        if time.monotonic() - at > self.view_ttl:
            # One read of the membership at a time: when the snapshot ages
            # out, the requests in flight wait on one read instead of each
            # making its own (a stampede at every expiry under load).
            if self._reading is None:
                self._reading = asyncio.ensure_future(self._read_nodes())
            reading = self._reading
            try:
                rows = await asyncio.shield(reading)
            finally:
                if reading.done() and self._reading is reading:
                    self._reading = None
        return rows

    async def _read_nodes(self) -> list[NodeRow]:
        rows = await nodes.list_nodes(self.db)
        self._view = (time.monotonic(), rows)
        self._apply_noted(rows)
        for state in (nodes.ALIVE, nodes.LOST, nodes.LEFT):
            metrics.GATEWAY_NODES.labels(state).set(sum(n.state == state for n in rows))
        return rows

    def note_layer(self, node: str, layer: LayerInfo) -> LayerInfo:
        """A layer `node` just made (a commit through this gateway): placed
        on at once. Its node's heartbeat reports it within a second or two;
        until then a create from it would land anywhere, and a project's
        commit is in no blob store for another node to fetch."""
        self._noted.append((time.monotonic(), node, layer))
        self._apply_noted(self._view[1])
        return layer

    def _apply_noted(self, rows: list[NodeRow]) -> None:
        self._noted = [x for x in self._noted if time.monotonic() - x[0] < NOTED_FOR]
        by_name = {row.name: row for row in rows}
        for _, node, layer in self._noted:  # oldest first: a later commit's tag wins
            row = by_name.get(node)
            if row is not None:
                # As ImageStore.inventory reports it: a parent only for a stack.
                stacked = (layer.parent or "") if layer.labels.get(STACK) else ""
                size = layer.meta_size + layer.blob_size
                row.capacity.layers.setdefault(layer.digest, (stacked, size))
                row.capacity.tags.update(dict.fromkeys(layer.names, layer.digest))
        self.inventory = placement.Inventory(rows)

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
        self,
        *,
        kind: str,
        layers: Sequence[str],
        memory: int,
        exclude: set[str],
        cpu: float = 0.0,
    ) -> NodeRow:
        """A node for one sandbox (made of `layers`: references, base first),
        counted in flight to it until release(): the count is taken in the
        same step as the choice (no await between), so a burst of concurrent
        creates sees each other's picks."""
        with trace.span("gateway.place", **{"sandbox.kind": kind}) as span:

            def pick(fleet: list[NodeRow]) -> NodeRow:
                return placement.choose(
                    fleet,
                    kind=kind,
                    want=self.inventory.wanted(layers),
                    memory=memory,
                    cpu=cpu,
                    in_flight=self.in_flight,
                    exclude=exclude,
                    k=self.k,
                )

            try:
                node = pick(await self.nodes())
            except ResourceExhausted:
                # The snapshot may predate a node that just joined or came
                # back (a preempted job restored onto new hosts): once more,
                # on the membership as it is now, before saying no.
                node = pick(await self.nodes(fresh=True))
            span.set("node", node.name)
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

    async def busy(self) -> bool:
        """Whether local utilisation has reached the burst threshold."""
        return utilisation(await self.nodes(), self.in_flight) >= self.burst.threshold

    async def watch(self, name: str, request: Awaitable[T]) -> T:
        """`request` to node `name`, abandoned if the node is marked lost
        meanwhile: a stopped node accepts connections and never answers, so
        without this a caller would wait out the HTTP timeout instead of the
        loss bound (node_timeout + a sweep)."""
        if name in self.burst.by_name:
            # Another cluster's gateway: it watches its own nodes.
            return await request
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
