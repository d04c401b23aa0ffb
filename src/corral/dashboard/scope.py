"""Who is looking, and which sandboxes, nodes and projects that caller sees.

The caller's key is checked by the API's own resolver (api/app.py), so the
dashboard can never see more than the API would serve that key:
- `corral serve`: the node's service; every sandbox on it, closed ones too
  (read from the node's store, which keeps them until they are purged);
- a gateway: the caller's project's view (control/view.py). A key of a
  project made an operator (`corral project create --operator`; `cluster
  up`'s "default") also sees every node and every project; any other
  project, a root one too, is a tenant.
  Any key sees the sandboxes of its project and of the projects under it
  (an ancestor may reach those through the API too).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from corral import labels as platform_labels
from corral.api.models import SandboxInfo
from corral.api.service import SandboxService
from corral.control import nodes, quotas
from corral.control.core import GatewayCore
from corral.control.view import GatewayView
from corral.log import get_logger
from corral.node.agent import NodeAgent
from corral.node.states import FINAL

log = get_logger("corral.dashboard")

ALL_STATES = (
    "creating",
    "running",
    "suspending",
    "suspended",
    "resuming",
    "closing",
    *sorted(FINAL),
)


@dataclass(frozen=True)
class Row:
    """What the list shows of a sandbox (cheaper than a SandboxInfo)."""

    id: str
    state: str
    kind: str
    image: str
    node: str
    created_at: float
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class Scope:
    svc: SandboxService
    agent: NodeAgent | None = None  # `corral serve`
    gateway: GatewayCore | None = None  # a gateway
    project: str | None = None  # the caller's project, on a gateway
    operator: bool = False  # may see every node and project
    keyed: bool = True  # a key was needed to get here (logout makes sense)

    async def rows(self, labels: dict[str, str] | None = None) -> list[Row]:
        if self.agent is not None:
            return node_rows(self.agent, labels)
        if self.gateway is not None and self.project is not None:
            return await self._gateway_rows(labels or {})
        return [info_row(s) for s in await self.svc.list(labels)]

    async def _gateway_rows(self, wanted: dict[str, str]) -> list[Row]:
        assert self.gateway is not None and self.project is not None
        projects = set(await subtree(self.gateway, self.project))
        alive = [n for n in await self.gateway.nodes() if n.state == nodes.ALIVE]
        found = await asyncio.gather(
            *(self.gateway.watch(n.name, self.gateway.client(n).list(wanted)) for n in alive),
            return_exceptions=True,
        )
        out: list[Row] = []
        for n, result in zip(alive, found, strict=True):
            if isinstance(result, BaseException):
                log.warning("dashboard.list_failed", node=n.name, error=str(result))
                continue
            out += [
                info_row(s) for s in result if s.labels.get(platform_labels.PROJECT) in projects
            ]
        return sorted(out, key=lambda r: r.created_at)


def info_row(s: SandboxInfo) -> Row:
    return Row(s.id, s.state.value, s.kind, s.image, s.node, s.created_at, s.labels)


def node_rows(agent: NodeAgent, labels: dict[str, str] | None = None) -> list[Row]:
    """Every sandbox the node's store holds, through the store's own list
    (closed and failed ones too, until the node purges them); not the
    node's own function-call workers."""
    node = agent.config.node
    return [
        Row(r.id, r.state, r.kind, str(r.spec.get("image", "")), node, r.created_at, r.labels)
        for r in agent.store.list(ALL_STATES, labels)
        if platform_labels.POOL not in r.labels
    ]


async def subtree(gateway: GatewayCore, project: str) -> list[str]:
    """`project` and every project under it."""
    children: dict[str | None, list[str]] = {}
    for p in await quotas.list_projects(gateway.db):
        children.setdefault(p.parent, []).append(p.name)
    out, todo = [], [project]
    while todo:
        name = todo.pop()
        out.append(name)
        todo += children.get(name, [])
    return out


async def scope_of(
    svc: SandboxService, agent: NodeAgent | None, gateway: GatewayCore | None, keyed: bool
) -> Scope:
    if isinstance(svc, GatewayView) and gateway is not None:
        operator = (await quotas.get_project(gateway.db, svc.project)).operator
        return Scope(svc, gateway=gateway, project=svc.project, operator=operator, keyed=keyed)
    return Scope(svc, agent=agent, operator=True, keyed=keyed)
