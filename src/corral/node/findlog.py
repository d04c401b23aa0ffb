"""A sandbox's findings (api/models_report.py) and the baselines of its
protected paths, in the node's store: kept after the sandbox closes (its
directory does not survive it), until closed sandboxes are purged.

Invariant: a finding, once recorded, never changes; the report adds the
findings it computes at read time (those of a running sandbox's file
system, its counters not yet tied to a command) beside the recorded ones.
"""

from __future__ import annotations

import builtins
import sqlite3

from corral.api.models import Finding
from corral.node.fschanges import Signature

DDL = """
    CREATE TABLE findings (
        sandbox_id TEXT NOT NULL,
        at         REAL NOT NULL,
        kind       TEXT NOT NULL,
        severity   TEXT NOT NULL,
        command    TEXT,
        detail     TEXT NOT NULL,
        count      INTEGER NOT NULL
    );
    CREATE INDEX findings_by_sandbox ON findings (sandbox_id);
    CREATE TABLE protected (
        sandbox_id TEXT NOT NULL,
        path       TEXT NOT NULL,
        what       TEXT NOT NULL,
        size       INTEGER NOT NULL,
        mtime_ns   INTEGER NOT NULL,
        PRIMARY KEY (sandbox_id, path)
    )
"""

MAX_PER_SANDBOX = 512  # findings recorded per sandbox; later ones add to the counts only


def add(db: sqlite3.Connection, sandbox_id: str, findings: builtins.list[Finding]) -> int:
    """Record findings (up to MAX_PER_SANDBOX a sandbox); returns how many."""
    if not findings:
        return 0
    (n,) = db.execute("SELECT COUNT(*) FROM findings WHERE sandbox_id=?", (sandbox_id,)).fetchone()
    room = max(0, MAX_PER_SANDBOX - n)
    rows = [
        (sandbox_id, f.at, f.kind, f.severity, f.command, f.detail[:1024], f.count)
        for f in findings[:room]
    ]
    db.executemany("INSERT INTO findings VALUES (?,?,?,?,?,?,?)", rows)
    return len(rows)


def of(db: sqlite3.Connection, sandbox_id: str) -> builtins.list[Finding]:
    return [
        Finding(
            sandbox=sandbox_id,
            at=at,
            kind=kind,
            severity=sev,
            command=cmd,
            detail=detail,
            count=count,
        )
        for at, kind, sev, cmd, detail, count in db.execute(
            "SELECT at, kind, severity, command, detail, count FROM findings "
            "WHERE sandbox_id=? ORDER BY at, rowid",
            (sandbox_id,),
        )
    ]


def set_baseline(
    db: sqlite3.Connection, sandbox_id: str, paths: dict[str, Signature | None]
) -> None:
    """The protected paths' upper entries now (None: the path has none)."""
    db.executemany(
        "INSERT OR REPLACE INTO protected VALUES (?,?,?,?,?)",
        [
            (sandbox_id, path, *(sig if sig is not None else ("", 0, 0)))
            for path, sig in paths.items()
        ],
    )


def baseline(db: sqlite3.Connection, sandbox_id: str) -> dict[str, Signature]:
    return {
        path: (what, size, mtime)
        for path, what, size, mtime in db.execute(
            "SELECT path, what, size, mtime_ns FROM protected WHERE sandbox_id=? AND what != ''",
            (sandbox_id,),
        )
    }


def drop(db: sqlite3.Connection, ids: builtins.list[str]) -> None:
    db.executemany("DELETE FROM findings WHERE sandbox_id=?", [(i,) for i in ids])
    db.executemany("DELETE FROM protected WHERE sandbox_id=?", [(i,) for i in ids])
