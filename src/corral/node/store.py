"""The node's record of its sandboxes and of everything each one holds.

Invariant: a resource (directory, subvolume, cgroup, container) is recorded
here *before* it is created, and the record is dropped only after it has been
released. So after any crash, every resource on the node is either owned by a
live sandbox or findable here and reclaimable. SQLite in WAL mode lets
several processes (an embedded client, ``corral serve``, the CLI) share one
node safely.
"""

from __future__ import annotations

import builtins
import json
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.errors import ResourceExhausted, Unavailable
from corral.node import findlog, steplog
from corral.node import states as st

SCHEMA_VERSION = 12

_MIGRATIONS: dict[int, str] = {
    1: """
    CREATE TABLE sandboxes (
        id          TEXT PRIMARY KEY,
        kind        TEXT NOT NULL,
        state       TEXT NOT NULL,
        spec        TEXT NOT NULL,
        memory      INTEGER NOT NULL,
        layers      TEXT NOT NULL,
        image_env   TEXT NOT NULL,
        image_user  TEXT,
        workdir     TEXT NOT NULL,
        created_at  REAL NOT NULL,
        expires_at  REAL,
        last_active REAL NOT NULL,
        init_pid    INTEGER,
        init_start  INTEGER,
        owner       TEXT NOT NULL,
        error       TEXT,
        closed_at   REAL
    );
    CREATE INDEX sandboxes_state ON sandboxes(state);
    CREATE TABLE labels (
        sandbox_id TEXT NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
        key        TEXT NOT NULL,
        value      TEXT NOT NULL,
        PRIMARY KEY (sandbox_id, key)
    );
    CREATE INDEX labels_kv ON labels(key, value);
    CREATE TABLE resources (
        sandbox_id TEXT NOT NULL,
        kind       TEXT NOT NULL,
        ref        TEXT NOT NULL,
        PRIMARY KEY (sandbox_id, kind, ref)
    );
    """,
    2: """
    CREATE TABLE audit (
        sandbox_id TEXT NOT NULL,
        key        TEXT NOT NULL,
        value      INTEGER NOT NULL,
        PRIMARY KEY (sandbox_id, key)
    );
    """,
    3: """
    CREATE TABLE net (
        sandbox_id TEXT PRIMARY KEY,
        idx        INTEGER NOT NULL UNIQUE,
        policy     TEXT NOT NULL
    );
    """,
    4: """
    CREATE TABLE idmap (
        sandbox_id TEXT PRIMARY KEY,
        slot       INTEGER NOT NULL UNIQUE
    );
    """,
    5: """
    CREATE TABLE idempotency (
        key        TEXT PRIMARY KEY,
        sandbox_id TEXT NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE
    );
    """,
    6: """
    ALTER TABLE sandboxes ADD COLUMN disk INTEGER NOT NULL DEFAULT 0;
    """,
    7: """
    ALTER TABLE sandboxes ADD COLUMN suspended TEXT;
    CREATE TABLE op_keys (
        sandbox_id TEXT NOT NULL,
        key        TEXT NOT NULL,
        digest     TEXT NOT NULL,
        started    REAL NOT NULL,
        result     TEXT,
        PRIMARY KEY (sandbox_id, key)
    );
    """
    + steplog.DDL
    + ";",
    8: findlog.DDL,
    # The CPUs promised, summed by admission as memory is.
    9: """
    ALTER TABLE sandboxes ADD COLUMN cpu REAL NOT NULL DEFAULT 0;
    UPDATE sandboxes SET cpu = COALESCE(json_extract(spec, '$.cpu'), 0);
    """,
    # Admission sums what active sandboxes were promised on every create: an
    # index holding the summed columns answers from itself, never touching
    # the rows (at 3,000 held, the row reads were 5 ms a create).
    10: """
    CREATE INDEX sandboxes_promised ON sandboxes(state, memory, cpu, disk);
    """,
    # The last_active of the idle spell whose memory housekeeping took back
    # (reclaim_after), so that a tick asks only for those not yet taken.
    11: """
    ALTER TABLE sandboxes ADD COLUMN reclaimed_for REAL;
    """,
    # Admission counts the containers holding a seccomp listener on every
    # create: from the index alone (at 10,000 held, 2.2 -> 0.3 ms a create).
    12: """
    CREATE INDEX sandboxes_state_kind ON sandboxes(state, kind);
    """,
}

# Every state but the final ones (node/states.py draws the machine).
ACTIVE_STATES = st.ACTIVE


@dataclass
class SandboxRecord:
    id: str
    kind: str
    state: str
    spec: dict[str, Any]
    layers: list[str]
    image_env: list[str]
    workdir: str
    created_at: float
    expires_at: float | None
    last_active: float
    owner: str
    init_pid: int | None = None
    init_start: int | None = None
    error: str | None = None
    closed_at: float | None = None
    labels: dict[str, str] = field(default_factory=dict)
    image_user: str | None = None
    suspended: str | None = None  # the depth of a suspended sandbox


@dataclass(frozen=True)
class Promised:
    """What the active sandboxes were promised, summed."""

    sandboxes: int
    memory: int
    cpu: float
    disk: int


_COLUMNS = (
    "id, kind, state, spec, layers, image_env, workdir, created_at, expires_at, "
    "last_active, owner, init_pid, init_start, error, closed_at, memory, image_user, disk, "
    "suspended, cpu"
)


def _row_to_record(row: sqlite3.Row, labels: dict[str, str]) -> SandboxRecord:
    return SandboxRecord(
        id=row["id"],
        kind=row["kind"],
        state=row["state"],
        spec=json.loads(row["spec"]),
        layers=json.loads(row["layers"]),
        image_env=json.loads(row["image_env"]),
        workdir=row["workdir"],
        created_at=row["created_at"],
        expires_at=row["expires_at"],
        last_active=row["last_active"],
        owner=row["owner"],
        init_pid=row["init_pid"],
        init_start=row["init_start"],
        error=row["error"],
        closed_at=row["closed_at"],
        labels=labels,
        image_user=row["image_user"],
        suspended=row["suspended"],
    )


def _unopenable(path: Path, exc: sqlite3.Error) -> Unavailable:
    return Unavailable(f"the node's records ({path}) cannot be opened: {exc}")


class Store:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        # One connection per Store; the agent uses it from its event loop
        # thread only. Each statement is short, so running it inline costs
        # less than a hop to a thread pool.
        try:
            self.db = sqlite3.connect(
                path, timeout=30, isolation_level=None, check_same_thread=False
            )
        except sqlite3.Error as exc:  # a directory in its place, no permission
            raise _unopenable(path, exc) from exc
        self.closed = False
        # Told of every state change made through this Store (the event
        # stream's source): (sandbox id, new state).
        self.on_transition: Callable[[str, str], None] | None = None
        try:
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("PRAGMA foreign_keys=ON")
            self._migrate()
        except sqlite3.Error as exc:  # a full disk, a file that is not a database
            self.db.close()
            raise _unopenable(path, exc) from exc

    def _migrate(self) -> None:
        with self.transaction():
            current = self.db.execute("PRAGMA user_version").fetchone()[0]
            for version in range(current + 1, SCHEMA_VERSION + 1):
                # executescript() would commit; run the statements one by one
                # so a migration applies entirely or not at all.
                for statement in _MIGRATIONS[version].split(";"):
                    if statement.strip():
                        self.db.execute(statement)
                self.db.execute(f"PRAGMA user_version={version}")

    def close(self) -> None:
        self.closed = True
        self.db.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE: take the write lock up front, so a read-then-write
        (admission) cannot interleave with another process's."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # ---------------------------------------------------------------- sandboxes

    def insert(self, rec: SandboxRecord) -> None:
        self.db.execute(
            f"INSERT INTO sandboxes ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
            (
                rec.id,
                rec.kind,
                rec.state,
                json.dumps(rec.spec),
                json.dumps(rec.layers),
                json.dumps(rec.image_env),
                rec.workdir,
                rec.created_at,
                rec.expires_at,
                rec.last_active,
                rec.owner,
                rec.init_pid,
                rec.init_start,
                rec.error,
                rec.closed_at,
                int(rec.spec.get("memory", 0)),
                rec.image_user,
                int(rec.spec.get("disk", 0)),
                rec.suspended,
                float(rec.spec.get("cpu", 0.0)),
            ),
        )
        self.db.executemany(
            "INSERT INTO labels (sandbox_id, key, value) VALUES (?,?,?)",
            [(rec.id, k, v) for k, v in rec.labels.items()],
        )
        if self.on_transition is not None:
            self.on_transition(rec.id, rec.state)

    def update(self, sandbox_id: str, **values: Any) -> None:
        if "state" in values:
            raise ValueError("a state changes through transition() (node/states.py)")
        cols = ", ".join(f"{k}=?" for k in values)
        self.db.execute(f"UPDATE sandboxes SET {cols} WHERE id=?", (*values.values(), sandbox_id))

    def set_labels(self, sandbox_id: str, labels: dict[str, str]) -> None:
        """Replace the sandbox's labels (a claimed warm sandbox takes its
        claimant's)."""
        self.db.execute("DELETE FROM labels WHERE sandbox_id=?", (sandbox_id,))
        self.db.executemany(
            "INSERT INTO labels (sandbox_id, key, value) VALUES (?,?,?)",
            [(sandbox_id, k, v) for k, v in labels.items()],
        )

    def transition(
        self, sandbox_id: str, from_states: Iterable[str], to_state: str, **values: Any
    ) -> bool:
        """Move to to_state (setting `values` too) only from one of
        from_states; False if another process got there first (exactly one
        closer wins). A change the state machine lacks is a ValueError."""
        states = list(from_states)
        st.check(states, to_state)
        sets = "".join(f", {k}=?" for k in values)
        cur = self.db.execute(
            f"UPDATE sandboxes SET state=?{sets} WHERE id=? "
            f"AND state IN ({','.join('?' * len(states))})",
            (to_state, *values.values(), sandbox_id, *states),
        )
        if cur.rowcount != 1:
            return False
        if self.on_transition is not None:
            self.on_transition(sandbox_id, to_state)
        return True

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        row = self.db.execute(
            f"SELECT {_COLUMNS} FROM sandboxes WHERE id=?", (sandbox_id,)
        ).fetchone()
        if row is None:
            return None
        return _row_to_record(row, self._labels([sandbox_id]).get(sandbox_id, {}))

    def _labels(self, ids: list[str]) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for chunk in range(0, len(ids), 500):
            part = ids[chunk : chunk + 500]
            marks = ",".join("?" * len(part))
            for sid, k, v in self.db.execute(
                f"SELECT sandbox_id, key, value FROM labels WHERE sandbox_id IN ({marks})", part
            ):
                out.setdefault(sid, {})[k] = v
        return out

    def list(
        self, states: Iterable[str] = ACTIVE_STATES, labels: dict[str, str] | None = None
    ) -> builtins.list[SandboxRecord]:
        states = list(states)
        sql = f"SELECT {_COLUMNS} FROM sandboxes WHERE state IN ({','.join('?' * len(states))})"
        args: builtins.list[Any] = list(states)
        for k, v in (labels or {}).items():
            sql += " AND id IN (SELECT sandbox_id FROM labels WHERE key=? AND value=?)"
            args += [k, v]
        rows = self.db.execute(sql + " ORDER BY created_at", args).fetchall()
        all_labels = self._labels([r["id"] for r in rows])
        return [_row_to_record(r, all_labels.get(r["id"], {})) for r in rows]

    def promised(self) -> Promised:
        """What active sandboxes hold: one pass over an index (migration 10)."""
        n, mem, cpu, disk = self.db.execute(
            "SELECT COUNT(*), COALESCE(SUM(memory), 0), COALESCE(SUM(cpu), 0), "
            "COALESCE(SUM(disk), 0) "
            f"FROM sandboxes WHERE state IN ({','.join('?' * len(ACTIVE_STATES))})",
            ACTIVE_STATES,
        ).fetchone()
        return Promised(int(n), int(mem), float(cpu), int(disk))

    def count_active(self, kinds: Iterable[str] | None = None) -> int:
        """Active sandboxes, of `kinds` only if given."""
        states = ",".join("?" * len(ACTIVE_STATES))
        if kinds is None:
            sql, args = f"SELECT COUNT(*) FROM sandboxes WHERE state IN ({states})", ACTIVE_STATES
        else:
            wanted = sorted(kinds)
            sql = (
                f"SELECT COUNT(*) FROM sandboxes WHERE state IN ({states}) "
                f"AND kind IN ({','.join('?' * len(wanted))})"
            )
            args = (*ACTIVE_STATES, *wanted)
        (n,) = self.db.execute(sql, args).fetchone()
        return int(n)

    def active_ids(self) -> set[str]:
        return {
            r[0]
            for r in self.db.execute(
                f"SELECT id FROM sandboxes WHERE state IN ({','.join('?' * len(ACTIVE_STATES))})",
                ACTIVE_STATES,
            )
        }

    # Housekeeping asks these every tick: each answers only what is due
    # (or the few columns a pass needs), so that a tick holds the event
    # loop for what changed, not for every sandbox held (at 10,000 held,
    # reading each running record into Python every second held the loop
    # ~30 ms of each second: the tail of every command's latency).

    def _tuples(self, sql: str, args: Any = ()) -> builtins.list[Any]:
        """Rows as plain tuples, unpacked by the caller (cheaper than Rows)."""
        cur = self.db.cursor()
        cur.row_factory = None
        return cur.execute(sql, args).fetchall()

    def due_to_retire(self, now: float) -> builtins.list[tuple[str, str, str]]:
        """Running sandboxes past their TTL or idle past their
        idle_timeout, as (id, reason, what to do: its on_expiry for a TTL,
        "close" for idleness)."""
        rows = self._tuples(
            "SELECT id, expires_at, idle, on_expiry FROM (SELECT id, expires_at, last_active, "
            "json_extract(spec, '$.idle_timeout') AS idle, "
            "json_extract(spec, '$.on_expiry') AS on_expiry FROM sandboxes "
            "WHERE state = 'running') "
            "WHERE (expires_at IS NOT NULL AND expires_at <= :now) "
            "OR (idle > 0 AND last_active + idle <= :now) ORDER BY last_active, id",
            {"now": now},
        )
        out = []
        for sid, exp, idle, on_expiry in rows:
            if exp is not None and exp <= now:
                out.append((sid, "ttl expired", on_expiry or "close"))
            else:
                out.append((sid, f"idle for {idle:.0f}s", "close"))
        return out

    def running_inits(self) -> builtins.list[tuple[str, int | None, int | None]]:
        """(id, init pid, init start) of every running sandbox."""
        return self._tuples(
            "SELECT id, init_pid, init_start FROM sandboxes WHERE state = 'running'"
        )

    def running_ids(self, kinds: Iterable[str] | None = None) -> builtins.list[str]:
        """Running sandboxes, of `kinds` only if given."""
        return self.ids_in(["running"], kinds)

    def ids_in(
        self, states: Iterable[str], kinds: Iterable[str] | None = None
    ) -> builtins.list[str]:
        """Sandboxes in one of `states`, of `kinds` only if given."""
        wanted = sorted(states)
        sql = f"SELECT id FROM sandboxes WHERE state IN ({','.join('?' * len(wanted))})"
        args = [*wanted]
        if kinds is not None:
            kinds = sorted(kinds)
            args += kinds
            sql += f" AND kind IN ({','.join('?' * len(kinds))})"
        return [r[0] for r in self._tuples(sql, args)]

    def running_labelled(self, key: str) -> builtins.list[tuple[str, str]]:
        """(id, owner) of the running sandboxes that carry label `key`."""
        return self._tuples(
            "SELECT id, owner FROM sandboxes WHERE state = 'running' "
            "AND id IN (SELECT sandbox_id FROM labels WHERE key = ?)",
            (key,),
        )

    def running_networked_own_disks(self) -> builtins.list[tuple[str, str]]:
        """(id, owner) of running sandboxes booted from a user's own disk
        that have a network: those whose guests ask for DHCP."""
        return self._tuples(
            "SELECT s.id, s.owner FROM sandboxes s JOIN net n ON n.sandbox_id = s.id "
            "WHERE s.state = 'running' AND json_extract(s.spec, '$.image') LIKE 'disk:%'",
            (),
        )

    def idle_unreclaimed(
        self, kinds: Iterable[str], before: float, most: int
    ) -> builtins.list[tuple[str, float]]:
        """(id, last_active) of running sandboxes of `kinds` unused since
        `before` whose memory was not yet taken back in this idle spell
        (mark_reclaimed), the longest idle first."""
        wanted = sorted(kinds)
        return self._tuples(
            "SELECT id, last_active FROM sandboxes WHERE state = 'running' "
            f"AND kind IN ({','.join('?' * len(wanted))}) AND last_active <= ? "
            "AND (reclaimed_for IS NULL OR reclaimed_for != last_active) "
            "ORDER BY last_active, id LIMIT ?",
            (*wanted, before, most),
        )

    def idle_to_suspend(
        self, kinds: Iterable[str], before: float, frozen_before: float | None, pool_label: str
    ) -> builtins.list[tuple[str, str, str]]:
        """(id, kind, state) of the sandboxes of `kinds`, none of them a
        pool's, that are running and unused since `before`, or frozen and
        unused since `frozen_before` (None: none frozen)."""
        wanted = sorted(kinds)
        if not wanted:
            return []
        frozen = "OR (state = 'suspended' AND suspended = 'freeze' AND last_active <= ?)"
        return self._tuples(
            "SELECT id, kind, state FROM sandboxes "
            f"WHERE kind IN ({','.join('?' * len(wanted))}) "
            f"AND ((state = 'running' AND last_active <= ?) {frozen if frozen_before else ''}) "
            "AND id NOT IN (SELECT sandbox_id FROM labels WHERE key = ?) ORDER BY last_active, id",
            (*wanted, before, *([frozen_before] if frozen_before else []), pool_label),
        )

    def mark_reclaimed(self, sandbox_id: str, last_active: float) -> None:
        """Its memory was taken back in the idle spell that began at
        `last_active`: not again until a command moves last_active on."""
        self.db.execute(
            "UPDATE sandboxes SET reclaimed_for = ? WHERE id = ?", (last_active, sandbox_id)
        )

    def count_labelled(self, key: str) -> int:
        """Active sandboxes carrying label `key` (any value)."""
        marks = ",".join("?" * len(ACTIVE_STATES))
        (n,) = self.db.execute(
            f"SELECT COUNT(*) FROM sandboxes WHERE state IN ({marks})"
            " AND id IN (SELECT sandbox_id FROM labels WHERE key=?)",
            [*ACTIVE_STATES, key],
        ).fetchone()
        return int(n)

    def touch(self, last_active: dict[str, float]) -> None:
        self.db.executemany(
            "UPDATE sandboxes SET last_active=MAX(last_active, ?) WHERE id=?",
            [(t, sid) for sid, t in last_active.items()],
        )

    def op_key(self, sandbox_id: str, key: str) -> bool:
        """Record that the operation `key` acted on a sandbox; False if it
        already had (a retried bulk call)."""
        cur = self.db.execute(
            "INSERT OR IGNORE INTO op_keys (sandbox_id, key, digest, started) VALUES (?,?,'',?)",
            (sandbox_id, key, time.time()),
        )
        return cur.rowcount == 1

    def exec_key(self, sandbox_id: str, key: str) -> tuple[str, str | None] | None:
        """(digest, result) of a keyed command: result None while it runs
        (or if it was lost with its agent)."""
        row = self.db.execute(
            "SELECT digest, result FROM op_keys WHERE sandbox_id=? AND key=?",
            (sandbox_id, f"exec:{key}"),
        ).fetchone()
        return None if row is None else (row[0], row[1])

    def exec_key_start(self, sandbox_id: str, key: str, digest: str) -> None:
        self.db.execute(
            "INSERT INTO op_keys (sandbox_id, key, digest, started) VALUES (?,?,?,?)",
            (sandbox_id, f"exec:{key}", digest, time.time()),
        )

    def exec_key_end(self, sandbox_id: str, key: str, result: str) -> None:
        self.db.execute(
            "UPDATE op_keys SET result=? WHERE sandbox_id=? AND key=?",
            (result, sandbox_id, f"exec:{key}"),
        )

    def exec_keys(self, sandbox_id: str) -> builtins.list[tuple[str, str, float, str | None]]:
        """Every keyed command's record of a sandbox (key, digest, started,
        result): what a saved sandbox takes along, so that a step replayed
        on its restored copy is still answered, not run again."""
        rows = self.db.execute(
            "SELECT key, digest, started, result FROM op_keys "
            "WHERE sandbox_id=? AND key LIKE 'exec:%'",
            (sandbox_id,),
        ).fetchall()
        return [(r[0].removeprefix("exec:"), r[1], r[2], r[3]) for r in rows]

    def import_exec_keys(
        self, sandbox_id: str, rows: Iterable[tuple[str, str, float, str | None]]
    ) -> None:
        self.db.executemany(
            "INSERT OR IGNORE INTO op_keys (sandbox_id, key, digest, started, result) "
            "VALUES (?,?,?,?,?)",
            [(sandbox_id, f"exec:{k}", d, t, r) for k, d, t, r in rows],
        )

    def count(self, sandbox_id: str, key: str, n: int = 1) -> None:
        """Add n to one of a sandbox's audit counters."""
        self.db.execute(
            "INSERT INTO audit (sandbox_id, key, value) VALUES (?,?,?) "
            "ON CONFLICT(sandbox_id, key) DO UPDATE SET value = value + excluded.value",
            (sandbox_id, key, n),
        )

    def counters(self, sandbox_id: str) -> dict[str, int]:
        return {
            k: int(v)
            for k, v in self.db.execute(
                "SELECT key, value FROM audit WHERE sandbox_id=?", (sandbox_id,)
            )
        }

    # ---------------------------------------------------------------- user ids

    def _lowest_free(self, table: str, column: str, first: int, end: int) -> int | None:
        """The lowest value in [first, end) that no row of `table` holds in
        its UNIQUE `column`. Without gaps (the usual case: blocks are taken
        in order), the count of held values and their maximum say so from
        the index alone; with gaps, the index is walked in order to the
        first held value whose successor is free. Reading every held value
        into Python was 3 ms a create at 3,000 held."""
        db = self.db
        n, top = db.execute(
            f"SELECT COUNT(*), MAX({column}) FROM {table} WHERE {column} >= ?", (first,)
        ).fetchone()
        if (
            top is None
            or db.execute(f"SELECT 1 FROM {table} WHERE {column} = ?", (first,)).fetchone() is None
        ):
            free = first
        elif n == top - first + 1:
            free = top + 1
        else:
            (free,) = db.execute(
                f"SELECT a.{column} + 1 FROM {table} a WHERE a.{column} >= ? AND NOT EXISTS "
                f"(SELECT 1 FROM {table} b WHERE b.{column} = a.{column} + 1) "
                f"ORDER BY a.{column} LIMIT 1",
                (first,),
            ).fetchone()
        return free if free < end else None

    def idmap_allocate(self, sandbox_id: str, slots: int) -> int:
        """The lowest free block of host ids (caller holds a transaction)."""
        slot = self._lowest_free("idmap", "slot", 0, slots)
        if slot is None:
            raise ResourceExhausted(f"node: all {slots} blocks of host ids are in use")
        self.db.execute("INSERT INTO idmap (sandbox_id, slot) VALUES (?,?)", (sandbox_id, slot))
        return slot

    def idmap_slot(self, sandbox_id: str) -> int | None:
        row = self.db.execute("SELECT slot FROM idmap WHERE sandbox_id=?", (sandbox_id,)).fetchone()
        return int(row[0]) if row else None

    def idmap_free(self, sandbox_id: str) -> None:
        self.db.execute("DELETE FROM idmap WHERE sandbox_id=?", (sandbox_id,))

    # ---------------------------------------------------------------- network

    def net_allocate(self, sandbox_id: str, policy: str, capacity: int) -> int:
        """The lowest free address block of the node (caller holds a
        transaction)."""
        idx = self._lowest_free("net", "idx", 1, capacity)  # block 0 is left alone
        if idx is None:
            raise ResourceExhausted(
                f"network: all {capacity - 1} sandbox address blocks are in use"
            )
        self.db.execute(
            "INSERT INTO net (sandbox_id, idx, policy) VALUES (?,?,?)", (sandbox_id, idx, policy)
        )
        return idx

    def net_get(self, sandbox_id: str) -> tuple[int, str] | None:
        row = self.db.execute(
            "SELECT idx, policy FROM net WHERE sandbox_id=?", (sandbox_id,)
        ).fetchone()
        return (int(row[0]), str(row[1])) if row else None

    def net_by_index(self, idx: int) -> tuple[str, str] | None:
        row = self.db.execute("SELECT sandbox_id, policy FROM net WHERE idx=?", (idx,)).fetchone()
        return (str(row[0]), str(row[1])) if row else None

    def net_set_policy(self, sandbox_id: str, policy: str) -> None:
        self.db.execute("UPDATE net SET policy=? WHERE sandbox_id=?", (policy, sandbox_id))

    def net_free(self, sandbox_id: str) -> None:
        self.db.execute("DELETE FROM net WHERE sandbox_id=?", (sandbox_id,))

    def net_indices(self) -> dict[int, str]:
        return {int(r[0]): str(r[1]) for r in self.db.execute("SELECT idx, sandbox_id FROM net")}

    def purge_closed(self, older_than: float) -> int:
        with self.transaction():
            ids = [
                r[0]
                for r in self.db.execute(
                    "SELECT id FROM sandboxes WHERE state IN ('closed','failed') "
                    "AND closed_at < ? AND id NOT IN (SELECT sandbox_id FROM resources)",
                    (older_than,),
                )
            ]
            self.db.executemany("DELETE FROM sandboxes WHERE id=?", [(i,) for i in ids])
            self.db.executemany("DELETE FROM audit WHERE sandbox_id=?", [(i,) for i in ids])
            self.db.executemany("DELETE FROM idempotency WHERE sandbox_id=?", [(i,) for i in ids])
            self.db.executemany("DELETE FROM op_keys WHERE sandbox_id=?", [(i,) for i in ids])
            findlog.drop(self.db, ids)
        return len(ids)

    # ---------------------------------------------------------------- idempotency

    def idempotent(self, key: str) -> str | None:
        """The sandbox a create with this key made (or is making)."""
        row = self.db.execute("SELECT sandbox_id FROM idempotency WHERE key=?", (key,)).fetchone()
        return str(row[0]) if row else None

    def idempotent_put(self, key: str, sandbox_id: str) -> None:
        self.db.execute("INSERT INTO idempotency (key, sandbox_id) VALUES (?,?)", (key, sandbox_id))

    def idempotent_drop(self, key: str, sandbox_id: str) -> None:
        self.db.execute("DELETE FROM idempotency WHERE key=? AND sandbox_id=?", (key, sandbox_id))

    # ---------------------------------------------------------------- resources

    def add_resource(self, sandbox_id: str, kind: str, ref: str) -> None:
        self.db.execute(
            "INSERT OR IGNORE INTO resources (sandbox_id, kind, ref) VALUES (?,?,?)",
            (sandbox_id, kind, ref),
        )

    def drop_resource(self, sandbox_id: str, kind: str, ref: str) -> None:
        self.db.execute(
            "DELETE FROM resources WHERE sandbox_id=? AND kind=? AND ref=?",
            (sandbox_id, kind, ref),
        )

    def resources(self, sandbox_id: str) -> builtins.list[tuple[str, str]]:
        return [
            (r[0], r[1])
            for r in self.db.execute(
                "SELECT kind, ref FROM resources WHERE sandbox_id=? ORDER BY rowid DESC",
                (sandbox_id,),
            )
        ]

    def all_resources(self) -> builtins.list[tuple[str, str, str]]:
        return [tuple(r) for r in self.db.execute("SELECT sandbox_id, kind, ref FROM resources")]

    def referenced_layers(self) -> set[str]:
        out: set[str] = set()
        for (layers,) in self.db.execute(
            f"SELECT layers FROM sandboxes WHERE state IN ({','.join('?' * len(ACTIVE_STATES))})",
            ACTIVE_STATES,
        ):
            out.update(json.loads(layers))
        return out
