"""The gateway: the sandbox API in front of many node agents.

A caller's API key names its project; the gateway serves it that project's
view (control/view.py), which places, charges and routes each request. The
shared state all views use (nodes, connections, creates in flight) is in
control/core.py. This module adds the gateway's own background work: the
sweep that writes silent nodes off, and reconciling a node whose sandboxes
disagree with the store.

A sandbox id is ``<node>-<16 hex>`` (corral.ids): the view checks the row
(the caller's project must own it, or be an ancestor of its owner) and
sends the request to that node agent's own HTTP endpoint. Ray is never on
this path.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from corral import labels, metrics
from corral.api.service import SandboxService
from corral.control import keys, nodes, placement, quotas, sandboxes
from corral.control.burst import Targets
from corral.control.core import GatewayCore
from corral.control.nodes import NodeRow
from corral.control.schema import migrate
from corral.control.view import GatewayView
from corral.db import Database
from corral.errors import CorralError, SandboxNotFound, Unavailable
from corral.log import bind, get_logger

log = get_logger("corral.gateway")

# A create a gateway abandoned (it died) is adopted or failed by the sweep
# once it is this old.
STALE_PLACING = 300.0
# API keys whose checks a gateway keeps (each re-checked every keys.RECHECK).
KEYS_SEEN = 10_000


class Gateway(GatewayCore):
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
        super().__init__(
            db,
            node_key=node_key,
            node_timeout=node_timeout,
            sweep_interval=sweep_interval,
            view_ttl=view_ttl,
            k=k,
            burst=burst,
        )
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
        await super().aclose()

    async def for_token(self, token: str) -> SandboxService:
        """The API as seen by the project that owns API key `token`."""
        now = time.monotonic()
        h = keys.hash_key(token)
        cached = self.keys_seen.get(h)
        if (
            cached is not None
            and now - cached[0] < keys.RECHECK
            and not cached[1].expired(time.time())
        ):
            grant = cached[1]
        else:
            self.keys_seen.pop(h, None)  # a revoked or expired key leaves the cache
            grant = await keys.check_key(self.db, token)
            if len(self.keys_seen) >= KEYS_SEEN:
                del self.keys_seen[next(iter(self.keys_seen))]  # the oldest seen
            self.keys_seen[h] = (now, grant)
        project = grant.project
        # The request's log lines name the project from here on; the API's
        # middleware (api/serving.py) ends the binding with the request.
        bind(project=project)
        return GatewayView(self, project, grant)

    async def is_operator(self, svc: SandboxService) -> bool:
        """Whether `svc` (a key's view) is an operator project's: it sees
        the gateway's metrics and every node and project."""
        if not isinstance(svc, GatewayView):
            return False
        return (await quotas.get_project(self.db, svc.project)).operator

    async def for_sandbox(self, sandbox_id: str) -> SandboxService:
        """The API as seen by the project that owns `sandbox_id`: for E2B's
        envd calls, which carry the sandbox's own token (checked against its
        labels by api/compat/e2b/envd.py), not a key."""
        row = await sandboxes.by_id(self.db, sandbox_id)
        if row is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id}", sandbox=sandbox_id)
        bind(project=row.project)
        return GatewayView(self, row.project)

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
        # One grouped count per sweep, not one query per node (160 a second
        # per replica on a DSec cell: docs/cell-simulation.md).
        counts = await sandboxes.counts_by_node(self.db)
        for n in await self.nodes(fresh=True):
            if n.state != nodes.ALIVE:
                continue
            if n.capacity.held == counts.get(n.name, 0):
                self._mismatch.pop(n.name, None)
                continue
            self._mismatch[n.name] = self._mismatch.get(n.name, 0) + 1
            if self._mismatch[n.name] >= 2:
                self._mismatch.pop(n.name, None)
                try:
                    async with asyncio.timeout(max(self.node_timeout, 5.0)):
                        await self.reconcile(n)
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
        held = [s for s in await client.list() if labels.KEY in s.labels]
        rows = await sandboxes.by_keys(self.db, [s.labels[labels.KEY] for s in held])
        out = {"closed_on_node": 0, "adopted": 0, "closed_in_store": 0, "failed": 0}
        seen: set[str] = set()
        for s in held:
            key = s.labels[labels.KEY]
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
