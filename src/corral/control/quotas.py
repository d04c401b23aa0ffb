"""Projects nested in levels (org / team / job) and what they may hold.

A sandbox is charged to its project and every ancestor, in the transaction
that records it; it is released, once, when it leaves the charged states.
Limits are checked at every level: a job under its own limit is still
refused when its team or org is full. A charge or a release is one
statement over the whole chain (a recursive walk of the parent links).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from corral.db import Database, Tx
from corral.errors import Conflict, InvalidArgument, NotFound, ResourceExhausted

_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
MAX_DEPTH = 8


@dataclass(frozen=True)
class Project:
    name: str
    parent: str | None
    max_sandboxes: int | None
    max_cpu: float | None
    max_memory: int | None
    used_sandboxes: int
    used_cpu: float
    used_memory: int
    operator: bool = False  # sees every node and project (dashboard, metrics)


_COLUMNS = (
    "name, parent, max_sandboxes, max_cpu, max_memory, used_sandboxes, used_cpu, used_memory, "
    "operator"
)


def _project(row: tuple[object, ...]) -> Project:
    name, parent, ms, mc, mm, us, uc, um, op = row
    return Project(
        str(name),
        None if parent is None else str(parent),
        None if ms is None else int(ms),  # type: ignore[call-overload]
        None if mc is None else float(mc),  # type: ignore[arg-type]
        None if mm is None else int(mm),  # type: ignore[call-overload]
        int(us),  # type: ignore[call-overload]
        # Sums of fractional CPUs drift (0.1 + 0.2 - 0.3 != 0): shown rounded.
        round(float(uc), 6) + 0.0,  # type: ignore[arg-type]
        int(um),  # type: ignore[call-overload]
        bool(op),
    )


async def create_project(
    db: Database,
    name: str,
    *,
    parent: str | None = None,
    max_sandboxes: int | None = None,
    max_cpu: float | None = None,
    max_memory: int | None = None,
    operator: bool = False,
) -> Project:
    if not _NAME.fullmatch(name):
        raise InvalidArgument("name", "must be 1-63 of [a-z0-9_-], starting alphanumeric", name)
    for field, value in (
        ("max_sandboxes", max_sandboxes),
        ("max_cpu", max_cpu),
        ("max_memory", max_memory),
    ):
        if value is not None and value < 0:
            raise InvalidArgument(field, "must be >= 0 (or unset for no limit)", value)
    async with db.transaction() as tx:
        if await tx.fetchone("SELECT 1 FROM projects WHERE name = %s", (name,)):
            raise Conflict(f"project {name!r} already exists", project=name)
        if parent is not None:
            chain = await _chain(tx, parent, lock=False)
            if len(chain) >= MAX_DEPTH:
                raise InvalidArgument("parent", f"nesting is at most {MAX_DEPTH} levels", parent)
        await tx.execute(
            "INSERT INTO projects (name, parent, max_sandboxes, max_cpu, max_memory, operator,"
            " created_at) VALUES (%s, %s, %s, %s, %s, %s, %s)",
            (name, parent, max_sandboxes, max_cpu, max_memory, operator, time.time()),
        )
        return _project(
            (name, parent, max_sandboxes, max_cpu, max_memory, 0, 0.0, 0, operator)  # fresh row
        )


async def get_project(db: Database, name: str) -> Project:
    async with db.transaction() as tx:
        row = await tx.fetchone(f"SELECT {_COLUMNS} FROM projects WHERE name = %s", (name,))
    if row is None:
        raise NotFound(f"no project {name!r}", project=name)
    return _project(row)


async def list_projects(db: Database) -> list[Project]:
    async with db.transaction() as tx:
        rows = await tx.fetchall(f"SELECT {_COLUMNS} FROM projects ORDER BY name")
    return [_project(r) for r in rows]


async def _chain(tx: Tx, name: str, *, lock: bool) -> list[Project]:
    """`name` and its ancestors, leaf first (locked for update if asked)."""
    out: list[Project] = []
    current: str | None = name
    while current is not None:
        if len(out) > MAX_DEPTH:
            raise InvalidArgument("project", "has a cycle in its parents", name)
        row = await tx.fetchone(
            f"SELECT {_COLUMNS} FROM projects WHERE name = %s" + (tx.for_update() if lock else ""),
            (current,),
        )
        if row is None:
            raise NotFound(f"no project {current!r}", project=current)
        project = _project(row)
        out.append(project)
        current = project.parent
    return out


async def ancestors(tx: Tx, name: str) -> list[str]:
    return [p.name for p in await _chain(tx, name, lock=False)]


# `project` and its ancestors, in one statement (a recursive walk of the
# parent links, bounded by MAX_DEPTH): both databases run it.
_CHAIN = (
    "WITH RECURSIVE chain(name, parent, depth) AS ("
    " SELECT name, parent, 0 FROM projects WHERE name = %s"
    " UNION ALL SELECT p.name, p.parent, c.depth + 1 FROM projects p"
    f" JOIN chain c ON p.name = c.parent WHERE c.depth < {MAX_DEPTH})"
)


async def charge(
    tx: Tx, project: str, cpu: float, memory: int, *, levels: int | None = None
) -> None:
    """Charge one sandbox up the chain, or raise ResourceExhausted naming
    the level, the resource, its limit and its use.

    One conditional UPDATE charges every level that has room; if any level
    did not (fewer rows than `levels`, the chain's length, which a caller
    may know already), the error is worked out and raised, and the caller's
    transaction rolls the partial charge back. Under PostgreSQL the WHERE is
    re-checked on the locked row, so concurrent charges cannot both pass a
    limit; SQLite has one writer at a time."""
    if levels is None:
        row = await tx.fetchone(_CHAIN + " SELECT COUNT(*) FROM chain", (project,))
        levels = int(row[0]) if row else 0
    await _lock_chain(tx, project)
    charged = await tx.fetchall(
        _CHAIN + " UPDATE projects SET used_sandboxes = used_sandboxes + 1,"
        " used_cpu = used_cpu + %s, used_memory = used_memory + %s"
        " WHERE name IN (SELECT name FROM chain)"
        " AND (max_sandboxes IS NULL OR used_sandboxes + 1 <= max_sandboxes)"
        " AND (max_cpu IS NULL OR used_cpu + %s <= max_cpu + 1e-9)"
        " AND (max_memory IS NULL OR used_memory + %s <= max_memory)"
        " RETURNING name",
        (project, cpu, memory, cpu, memory),
    )
    if len(charged) >= levels > 0:
        return
    done = {str(r[0]) for r in charged}
    for p in await _chain(tx, project, lock=False):  # leaf first; NotFound if none
        if p.name in done:
            continue
        checks = (
            ("sandboxes", p.used_sandboxes + 1, p.max_sandboxes, p.used_sandboxes),
            ("cpu", p.used_cpu + cpu, p.max_cpu, p.used_cpu),
            ("memory", p.used_memory + memory, p.max_memory, p.used_memory),
        )
        for resource, wanted, limit, used in checks:
            if limit is not None and wanted > limit + 1e-9:
                where = "" if p.name == project else f" (an ancestor of {project!r})"
                raise ResourceExhausted(
                    f"quota exceeded: project {p.name!r}{where} has {used:g} of {limit:g} "
                    f"{resource} in use; this sandbox needs "
                    f"{1 if resource == 'sandboxes' else cpu if resource == 'cpu' else memory:g}",
                    project=p.name,
                    resource=resource,
                    limit=limit,
                    used=used,
                    quota=True,
                )
    # A level changed between the two statements (the caller's `levels` was
    # stale): refuse rather than leave a partial charge.
    raise ResourceExhausted(f"quota of project {project!r} changed; retry", project=project)


async def _lock_chain(tx: Tx, project: str) -> None:
    """Lock the chain's rows by name, before changing them. An UPDATE over
    the chain locks its rows in heap order, which moves with every update
    (a new row version): two charges of one job then took them in opposite
    orders and deadlocked (bench/results/cellsim.md found it). One order,
    by name, for every charge and release: no deadlock. NO KEY UPDATE, the
    lock an UPDATE of non-key columns takes anyway, so inserting a sandbox
    (whose foreign key share-locks its project) never waits on it."""
    if tx.dialect == "postgresql":  # SQLite has one writer at a time
        await tx.fetchall(
            _CHAIN + " SELECT name FROM projects WHERE name IN (SELECT name FROM chain)"
            " ORDER BY name FOR NO KEY UPDATE",
            (project,),
        )


async def release(tx: Tx, project: str, cpu: float, memory: int) -> None:
    await _lock_chain(tx, project)
    await tx.execute(
        _CHAIN + " UPDATE projects SET used_sandboxes = used_sandboxes - 1,"
        " used_cpu = used_cpu - %s, used_memory = used_memory - %s"
        " WHERE name IN (SELECT name FROM chain)",
        (project, cpu, memory),
    )
