"""`corral cluster up/status/down` and `corral project create/ls/key`: a
cluster of node agents and a gateway, and the projects (quotas, API keys)
in its state store."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from rich.table import Table

from corral.cli.output import console, emit
from corral.units import format_size, parse_size

if TYPE_CHECKING:
    from corral.db import Database

# ---------------------------------------------------------------- projects


async def _state(a: argparse.Namespace) -> Database:
    """The state store of --state, else of the cluster in --cluster-dir;
    migrated, so a fresh one works too."""
    from corral.cluster.up import load
    from corral.control.schema import migrate
    from corral.db import connect

    url = a.state or load(a.cluster_dir)["state"]
    db = await connect(url)
    await migrate(db)
    return db


async def project_create(a: argparse.Namespace) -> int:
    from corral.control import quotas

    db = await _state(a)
    try:
        p = await quotas.create_project(
            db,
            a.name,
            parent=a.parent,
            max_sandboxes=a.max_sandboxes,
            max_cpu=a.max_cpu,
            max_memory=parse_size(a.max_memory, "max_memory") if a.max_memory else None,
            operator=a.operator,
        )
    finally:
        await db.aclose()
    emit(a, p.__dict__, f"project {p.name} created")
    return 0


async def project_ls(a: argparse.Namespace) -> int:
    from corral.control import quotas

    db = await _state(a)
    try:
        projects = await quotas.list_projects(db)
    finally:
        await db.aclose()
    table = Table("project", "parent", "sandboxes", "cpu", "memory")

    def cell(used: float, limit: float | None, fmt: Any = str) -> str:
        return f"{fmt(used)} / {'-' if limit is None else fmt(limit)}"

    for p in projects:
        table.add_row(
            p.name,
            p.parent or "",
            cell(p.used_sandboxes, p.max_sandboxes),
            cell(p.used_cpu, p.max_cpu, lambda v: f"{v:g}"),
            cell(p.used_memory, p.max_memory, format_size),
        )
    emit(a, [p.__dict__ for p in projects], table)
    return 0


async def project_key(a: argparse.Namespace) -> int:
    import time

    from corral.control import keys

    expires = keys.parse_expiry(a.expires, now=time.time()) if a.expires else None
    db = await _state(a)
    try:
        key, info = await keys.create_key(db, a.name, expires_at=expires, note=a.note or "")
    finally:
        await db.aclose()
    until = f", expires {keys.moment(expires)}" if expires else ""
    emit(a, {"api_key": key, **info.__dict__}, f"{key}\n(id {info.id}{until}: shown once)")
    return 0


async def project_keys(a: argparse.Namespace) -> int:
    from corral.control import keys

    db = await _state(a)
    try:
        got = await keys.list_keys(db, a.name)
    finally:
        await db.aclose()
    table = Table("id", "project", "created", "expires", "revoked", "last used", "made by", "note")

    def when(t: float | None) -> str:
        return "" if t is None else keys.moment(t)

    for k in got:
        row = (k.created_at, k.expires_at, k.revoked_at, k.last_used_at)
        table.add_row(k.id, k.project, *map(when, row), k.created_by or "", k.note)
    emit(a, [k.__dict__ for k in got], table)
    return 0


async def project_revoke(a: argparse.Namespace) -> int:
    from corral.control import keys

    db = await _state(a)
    try:
        info, also = await keys.revoke_key(db, a.key)
    finally:
        await db.aclose()
    assert info.revoked_at is not None
    said = f"key {info.id} of {info.project} revoked at {keys.moment(info.revoked_at)}"
    if also:
        said += f", with the {len(also)} keys made from it ({', '.join(also)})"
    said += f" (gateways refuse them within {keys.RECHECK:g} s)"
    emit(a, {**info.__dict__, "also_revoked": also}, said)
    return 0


# ---------------------------------------------------------------- cluster


async def cluster_up(a: argparse.Namespace) -> int:
    from corral.cluster.up import up
    from corral.control.burst import load_targets

    burst = load_targets(a.burst_targets) if a.burst_targets else []
    doc = await up(
        a.dir,
        local_nodes=a.local_nodes,
        ray_address=a.ray_address,
        ray_port=a.ray_port,
        state=a.state,
        pg_port=a.pg_port,
        gateway_host=a.gateway_host,
        gateway_port=a.gateway_port,
        node_port=a.node_port,
        dns_port=a.dns_port,
        node_timeout=a.node_timeout,
        images=a.images,
        blobs=a.blobs,
        timeout=a.timeout,
        burst=[t.to_json() for t in burst],
        burst_threshold=a.burst_threshold,
        say=lambda line: console.print(line, highlight=False),
    )
    if a.json:
        print(json.dumps({"gateway": doc["gateway"], "nodes": doc["nodes"]}))
    return 0


async def cluster_status(a: argparse.Namespace) -> int:
    from corral.cluster.up import status

    rows = await status(a.dir)
    table = Table("node", "url", "state", "heartbeat", "sandboxes", "gateway's", "memory promised")
    for n in rows:
        c = n.capacity
        table.add_row(
            n.name,
            n.url,
            n.state,
            f"{n.heartbeat_age:.1f} s ago",
            f"{c.active} / {c.max_sandboxes}",
            str(c.held),
            f"{format_size(c.memory_promised)} / {format_size(c.memory_budget)}",
        )
    emit(a, [{**n.__dict__, "capacity": n.capacity.to_wire()} for n in rows], table)
    return 0


async def cluster_down(a: argparse.Namespace) -> int:
    from corral.cluster.down import down

    await down(a.dir, say=lambda line: console.print(line, highlight=False))
    return 0
