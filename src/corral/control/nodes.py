"""Cluster membership: node agents heartbeat their capacity; silence is death.

A node agent writes its row every `interval` seconds (upsert, on the
database's clock). A node whose last heartbeat is older than the timeout is
marked lost by whichever gateway sweeps first (the update is conditional, so
sweeps from several replicas agree), and its sandboxes are written off with
it, their quota released: a ready one is marked lost (never recreated: its
caller held it), one still being placed is failed (its create places it
again elsewhere). A lost node that heartbeats again is alive again and is
reconciled (gateway.py): whatever it still holds for written-off sandboxes
is closed on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from corral.capacity import NodeCapacity
from corral.control import quotas
from corral.db import Database

ALIVE = "alive"
LOST = "lost"
LEFT = "left"


@dataclass(frozen=True)
class NodeRow:
    name: str
    url: str
    state: str
    heartbeat_age: float  # seconds since the last heartbeat, database clock
    capacity: NodeCapacity = field(default_factory=NodeCapacity)  # as of that heartbeat


async def heartbeat(db: Database, name: str, url: str, capacity: NodeCapacity) -> str | None:
    """Record that `name` is alive at `url`; returns its state before."""
    async with db.transaction() as tx:
        row = await tx.fetchone("SELECT state FROM nodes WHERE name = %s", (name,))
        await tx.execute(
            "INSERT INTO nodes (name, url, state, capacity, heartbeat_at, joined_at)"
            " VALUES (%s, %s, %s, %s, $NOW, $NOW)"
            " ON CONFLICT (name) DO UPDATE SET url = excluded.url, state = excluded.state,"
            " capacity = excluded.capacity, heartbeat_at = excluded.heartbeat_at",
            (name, url, ALIVE, json.dumps(capacity.to_wire(), sort_keys=True)),
        )
    return None if row is None else str(row[0])


async def leave(db: Database, name: str) -> None:
    """A node going away on purpose (it closed its sandboxes first)."""
    async with db.transaction() as tx:
        await tx.execute("UPDATE nodes SET state = %s WHERE name = %s", (LEFT, name))


async def list_nodes(db: Database) -> list[NodeRow]:
    async with db.transaction() as tx:
        rows = await tx.fetchall(
            "SELECT name, url, state, $NOW - heartbeat_at, capacity FROM nodes ORDER BY name"
        )
    return [
        NodeRow(str(n), str(u), str(s), float(a), NodeCapacity.from_wire(json.loads(str(c))))
        for n, u, s, a, c in rows
    ]


async def sweep_lost(db: Database, timeout: float) -> list[str]:
    """Mark silent nodes lost and write off their sandboxes; returns the
    nodes newly lost. Safe to run from every gateway at once."""
    async with db.transaction() as tx:
        rows = await tx.fetchall(
            "UPDATE nodes SET state = %s WHERE state = %s AND heartbeat_at < $NOW - %s"
            " RETURNING name",
            (LOST, ALIVE, timeout),
        )
        lost = [str(r[0]) for r in rows]
        for name in lost:
            why = f"node {name} stopped heartbeating for more than {timeout:g} s"
            # A ready sandbox is lost: the caller held it, and must hear so.
            # A placing one was never handed out: it fails, and its create
            # (or a retry with its key) places it again elsewhere.
            written_off = await tx.fetchall(
                "UPDATE sandboxes SET state = CASE state WHEN 'ready' THEN 'lost' ELSE 'failed'"
                " END, updated_at = $NOW, error = %s"
                " WHERE node = %s AND state IN ('placing', 'ready')"
                " RETURNING project, cpu, memory",
                (why, name),
            )
            for project, cpu, memory in written_off:
                await quotas.release(tx, str(project), float(cpu), int(memory))
    return lost
