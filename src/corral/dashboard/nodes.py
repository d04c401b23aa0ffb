"""The nodes and projects pages."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from corral.capacity import NodeCapacity
from corral.control import quotas
from corral.control.nodes import NodeRow
from corral.control.quotas import Project
from corral.dashboard.render import Safe, badge, size, table, tag
from corral.dashboard.scope import Scope, subtree
from corral.host import pressure as psi


def pressure(root: Path = psi.PRESSURE) -> dict[str, str]:
    """The kernel's pressure stall averages (PSI), `some` and `full` over
    10 s, per resource; empty where the kernel has no PSI."""
    return {
        res: f"some {stall.some:.2f}%, full {stall.full:.2f}%"
        for res, stall in psi.read(root).items()
    }


def _pressure_cell(psi: dict[str, str]) -> str:
    if not psi:
        return "PSI not available"
    return "; ".join(f"{k}: {v}" for k, v in psi.items())


def _use(used: float, limit: float | None, fmt: str = "{:g}") -> str:
    shown = fmt.format(used)
    return f"{shown} / {'∞' if limit is None else fmt.format(limit)}"


def _mem(used: int, budget: int) -> str:
    return f"{size(used)} / {size(budget)}"


NODE_HEADS = (
    "node",
    "state",
    "heartbeat",
    "sandboxes (active / max)",
    "held for the gateway",
    "memory (promised / budget)",
    "cpus",
    "kinds",
    "pressure (avg10)",
)


def node_line(
    name: str, state: str, beat: str, cap: NodeCapacity, psi: str
) -> tuple[str | Safe, ...]:
    tone = {"alive": "ok", "lost": "bad"}.get(state, "muted")
    return (
        name,
        badge(state, tone),
        beat,
        f"{cap.active} / {cap.max_sandboxes}",
        str(cap.held),
        _mem(cap.memory_promised, cap.memory_budget),
        str(cap.cpus),
        ", ".join(cap.kinds),
        psi,
    )


def gateway_nodes_table(rows: Sequence[NodeRow]) -> Safe:
    if not rows:
        return tag("p", "no node has joined this cluster", id="nodes")
    lines = [
        node_line(
            n.name,
            n.state,
            f"{n.heartbeat_age:.1f} s ago",
            n.capacity,
            "on the node (its /ui/nodes)",
        )
        for n in rows
    ]
    return table(NODE_HEADS, lines, id="nodes")


async def nodes_page(scope: Scope) -> Safe:
    if scope.agent is not None:
        cap = scope.agent.capacity()
        line = node_line(
            scope.agent.config.node, "alive", "this process", cap, _pressure_cell(pressure())
        )
        note = tag("p", "corral serve: one node, this one.", class_="muted")
        return note + table(NODE_HEADS, [line], id="nodes")
    if scope.gateway is None:
        return tag("p", "no node information behind this service", id="nodes")
    if not scope.operator:
        return tag(
            "p",
            "Nodes are shown to an operator: a key of an operator project "
            "(corral project create NAME --operator).",
            id="nodes",
        )
    return gateway_nodes_table(await scope.gateway.nodes(fresh=True))


# ---------------------------------------------------------------- projects


def project_tree(projects: Sequence[Project], roots: Sequence[str]) -> list[tuple[int, Project]]:
    """Depth-first from `roots`, each project with its depth."""
    by_name = {p.name: p for p in projects}
    children: dict[str | None, list[str]] = {}
    for p in projects:
        children.setdefault(p.parent, []).append(p.name)
    out: list[tuple[int, Project]] = []

    def walk(name: str, depth: int) -> None:
        out.append((depth, by_name[name]))
        for child in sorted(children.get(name, [])):
            walk(child, depth + 1)

    for r in roots:
        if r in by_name:
            walk(r, 0)
    return out


def projects_table(tree: Sequence[tuple[int, Project]], mine: str | None = None) -> Safe:
    rows = [
        (
            Safe("&nbsp;&nbsp;" * depth) + tag("span", p.name, class_="project"),
            p.parent or "-",
            _use(p.used_sandboxes, p.max_sandboxes),
            _use(p.used_cpu, p.max_cpu),
            f"{size(p.used_memory)} / {'∞' if p.max_memory is None else size(p.max_memory)}",
            "you" if p.name == mine else "",
        )
        for depth, p in tree
    ]
    heads = ("project", "parent", "sandboxes", "cpu", "memory", "")
    return table(heads, rows, id="projects")


async def projects_page(scope: Scope) -> Safe:
    if scope.gateway is None or scope.project is None:
        return tag("p", "A single node has no projects: they are a cluster's.", id="projects")
    every = await quotas.list_projects(scope.gateway.db)
    if scope.operator:
        roots = sorted(p.name for p in every if p.parent is None)
        return projects_table(project_tree(every, roots), scope.project)
    # A project's key sees the limits it is under (its ancestors', which
    # refuse it when full) and what is under it; not its siblings.
    chain = await scope.gateway.chain(scope.project)  # itself first, then up
    mine = set(await subtree(scope.gateway, scope.project)) | set(chain)
    seen = [p for p in every if p.name in mine]
    by_name = {p.name: p for p in seen}
    above = [(i, by_name[n]) for i, n in enumerate(reversed(chain[1:])) if n in by_name]
    below = project_tree(seen, [scope.project])
    depth = len(above)
    rows = above + [(d + depth, p) for d, p in below]
    note = tag("p", "Your project, the limits above it, and what is under it.", class_="muted")
    return note + projects_table(rows, scope.project)
