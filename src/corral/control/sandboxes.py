"""The gateway's record of each sandbox: which node, which project, what state.

    placing --ready()--> ready --close()--> closed
       |                   |
       +--fail()--> failed +--node lost--> lost --close()--> closed

A row is written (and its quota charged) before any node is asked, under a
key that is also the node-level idempotency key. So a gateway that dies
mid-create leaves a row a retry finds, and re-driving the create on the
row's node can only return the sandbox already made there. `placing` and
`ready` hold quota; leaving them releases it, exactly once (the state
change and the release share a transaction, conditional on the old state).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from corral.control import quotas
from corral.db import Database, Tx

CHARGED = ("placing", "ready")


@dataclass(frozen=True)
class SandboxRow:
    key: str
    id: str | None
    node: str
    project: str
    state: str
    kind: str
    cpu: float
    memory: int
    age: float
    error: str | None
    remote_id: str | None = None  # its id in a burst target's cluster


_COLUMNS = "key, id, node, project, state, kind, cpu, memory, $NOW - created_at, error, remote_id"


def _row(r: tuple[object, ...]) -> SandboxRow:
    key, sid, node, project, state, kind, cpu, memory, age, error, remote = r
    return SandboxRow(
        str(key),
        None if sid is None else str(sid),
        str(node),
        str(project),
        str(state),
        str(kind),
        float(cpu),  # type: ignore[arg-type]
        int(memory),  # type: ignore[call-overload]
        float(age),  # type: ignore[arg-type]
        None if error is None else str(error),
        None if remote is None else str(remote),
    )


def node_key(project: str, client_key: str) -> str:
    """The node-level idempotency key for a client's key in a project: two
    projects using the same key never meet."""
    digest = hashlib.sha256(f"{project}\0{client_key}".encode()).hexdigest()[:40]
    return f"gw:{digest}"


async def reserve(
    db: Database,
    key: str,
    project: str,
    node: str,
    kind: str,
    cpu: float,
    memory: int,
    *,
    levels: int | None = None,
) -> tuple[SandboxRow, bool]:
    """The row for `key`: the existing one (False), or a new one on `node`,
    charged to `project` (True). A failed row is charged and placed again.
    `levels`: the length of the project's chain, if the caller knows it."""
    async with db.transaction() as tx:
        # The common case, a new key, in two statements: the row, then the
        # charge (a refusal rolls the row back with it).
        new = await tx.fetchone(
            "INSERT INTO sandboxes (key, node, project, state, kind, cpu, memory,"
            " created_at, updated_at) VALUES (%s, %s, %s, 'placing', %s, %s, %s, $NOW, $NOW)"
            f" ON CONFLICT (key) DO NOTHING RETURNING {_COLUMNS}",
            (key, node, project, kind, cpu, memory),
        )
        if new is None:
            found = await tx.fetchone(
                f"SELECT {_COLUMNS} FROM sandboxes WHERE key = %s" + tx.for_update(), (key,)
            )
            assert found is not None
            if _row(found).state != "failed":
                return _row(found), False
            new = await tx.fetchone(
                "UPDATE sandboxes SET state = 'placing', node = %s, id = NULL, error = NULL,"
                f" updated_at = $NOW WHERE key = %s RETURNING {_COLUMNS}",
                (node, key),
            )
            assert new is not None
        await quotas.charge(tx, project, cpu, memory, levels=levels)
        return _row(new), True


async def move(db: Database, key: str, old: str, new: str) -> bool:
    """Re-place a create its node refused (full): only if still placing on
    `old`, so two gateways re-driving one key cannot split it."""
    async with db.transaction() as tx:
        n = await tx.execute(
            "UPDATE sandboxes SET node = %s, updated_at = $NOW"
            " WHERE key = %s AND node = %s AND state = 'placing'",
            (new, key, old),
        )
    return n == 1


async def mark_ready(
    db: Database, key: str, sandbox_id: str, remote_id: str | None = None
) -> SandboxRow | None:
    """placing -> ready (or already ready with this id: an earlier attempt
    committed and lost its answer); None if the row left placing meanwhile
    (its node was written off while the create ran)."""
    async with db.transaction() as tx:
        found = await tx.fetchone(
            "UPDATE sandboxes SET state = 'ready', id = %s, remote_id = %s, updated_at = $NOW"
            " WHERE key = %s AND (state = 'placing' OR (state = 'ready' AND id = %s))"
            f" RETURNING {_COLUMNS}",
            (sandbox_id, remote_id, key, sandbox_id),
        )
    return None if found is None else _row(found)


async def finish(db: Database, key: str, state: str, error: str | None = None) -> bool:
    """Leave the charged states for `state` (closed or failed), releasing
    the quota; False if the row had already left them."""
    async with db.transaction() as tx:
        return await _finish(tx, key, state, error)


async def _finish(tx: Tx, key: str, state: str, error: str | None) -> bool:
    rows = await tx.fetchall(
        "UPDATE sandboxes SET state = %s, error = COALESCE(%s, error), updated_at = $NOW"
        " WHERE key = %s AND state IN ('placing', 'ready') RETURNING project, cpu, memory",
        (state, error, key),
    )
    for project, cpu, memory in rows:
        await quotas.release(tx, str(project), float(cpu), int(memory))
    if not rows and state == "closed":
        # lost -> closed: the caller has acknowledged it; nothing to release.
        await tx.execute(
            "UPDATE sandboxes SET state = 'closed', updated_at = $NOW"
            " WHERE key = %s AND state = 'lost'",
            (key,),
        )
    return bool(rows)


async def by_id(db: Database, sandbox_id: str) -> SandboxRow | None:
    async with db.transaction() as tx:
        found = await tx.fetchone(f"SELECT {_COLUMNS} FROM sandboxes WHERE id = %s", (sandbox_id,))
    return None if found is None else _row(found)


async def by_keys(db: Database, keys: list[str]) -> dict[str, SandboxRow]:
    if not keys:
        return {}
    async with db.transaction() as tx:
        rows = await tx.fetchall(
            f"SELECT {_COLUMNS} FROM sandboxes WHERE key IN ({', '.join(['%s'] * len(keys))})",
            keys,
        )
    return {r.key: r for r in map(_row, rows)}


async def on_node(db: Database, node: str, states: tuple[str, ...] = CHARGED) -> list[SandboxRow]:
    async with db.transaction() as tx:
        rows = await tx.fetchall(
            f"SELECT {_COLUMNS} FROM sandboxes WHERE node = %s"
            f" AND state IN ({', '.join(['%s'] * len(states))})",
            (node, *states),
        )
    return [_row(r) for r in rows]


async def of_projects(db: Database, projects: list[str]) -> list[SandboxRow]:
    async with db.transaction() as tx:
        rows = await tx.fetchall(
            f"SELECT {_COLUMNS} FROM sandboxes WHERE state IN ('ready', 'lost')"
            f" AND project IN ({', '.join(['%s'] * len(projects))})",
            projects,
        )
    return [_row(r) for r in rows]


async def ready_on(db: Database, node: str, project: str) -> list[SandboxRow]:
    """A project's ready sandboxes on one node (or burst target)."""
    async with db.transaction() as tx:
        rows = await tx.fetchall(
            f"SELECT {_COLUMNS} FROM sandboxes WHERE node = %s AND project = %s"
            " AND state = 'ready'",
            (node, project),
        )
    return [_row(r) for r in rows]


async def counts_by_node(db: Database) -> dict[str, int]:
    """Charged rows per node (and burst target)."""
    async with db.transaction() as tx:
        rows = await tx.fetchall(
            "SELECT node, COUNT(*) FROM sandboxes WHERE state IN ('placing', 'ready') GROUP BY node"
        )
    return {str(n): int(c) for n, c in rows}


async def count_on_node(db: Database, node: str) -> int:
    async with db.transaction() as tx:
        row = await tx.fetchone(
            "SELECT COUNT(*) FROM sandboxes WHERE node = %s AND state IN ('placing', 'ready')",
            (node,),
        )
    return int(row[0]) if row else 0
