"""The control plane's schema, as numbered migrations.

A migration is applied once, in order, in the same transaction as the bump
of ``corral_schema.version``; PostgreSQL serialises concurrent migrators
(several gateways starting at once) with an advisory lock. A database newer
than this code is refused rather than guessed at. Migrations are append-only:
a released one is never edited.
"""

from __future__ import annotations

from corral.db import Database
from corral.errors import Unavailable
from corral.node import steplog

MIGRATIONS: list[list[str]] = [
    # 1: projects (nested: org / team / job), API keys, nodes, sandboxes.
    [
        """CREATE TABLE projects (
            name TEXT PRIMARY KEY,
            parent TEXT REFERENCES projects(name),
            max_sandboxes BIGINT,
            max_cpu DOUBLE PRECISION,
            max_memory BIGINT,
            used_sandboxes BIGINT NOT NULL DEFAULT 0,
            used_cpu DOUBLE PRECISION NOT NULL DEFAULT 0,
            used_memory BIGINT NOT NULL DEFAULT 0,
            created_at DOUBLE PRECISION NOT NULL
        )""",
        """CREATE TABLE api_keys (
            key_hash TEXT PRIMARY KEY,
            project TEXT NOT NULL REFERENCES projects(name),
            created_at DOUBLE PRECISION NOT NULL
        )""",
        """CREATE TABLE nodes (
            name TEXT PRIMARY KEY,
            url TEXT NOT NULL,
            state TEXT NOT NULL,
            capacity TEXT NOT NULL,
            heartbeat_at DOUBLE PRECISION NOT NULL,
            joined_at DOUBLE PRECISION NOT NULL
        )""",
        # key: the node-level idempotency key the gateway sends, chosen
        # before the node is asked, so a retried or re-driven create can only
        # ever find the same sandbox. id: the node's sandbox id, once known.
        """CREATE TABLE sandboxes (
            key TEXT PRIMARY KEY,
            id TEXT UNIQUE,
            node TEXT NOT NULL,
            project TEXT NOT NULL REFERENCES projects(name),
            state TEXT NOT NULL,
            kind TEXT NOT NULL,
            cpu DOUBLE PRECISION NOT NULL,
            memory BIGINT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL,
            error TEXT
        )""",
        "CREATE INDEX sandboxes_node_state ON sandboxes(node, state)",
        "CREATE INDEX sandboxes_project_state ON sandboxes(project, state)",
    ],
    # 2: rollout logs (node/steplog.py).
    [steplog.DDL],
    # 3: a sandbox placed on a burst target (control/burst.py): its node
    # column names the target, remote_id its id in that other cluster.
    ["ALTER TABLE sandboxes ADD COLUMN remote_id TEXT"],
    # 4: who operates the cluster (sees every node and project on the
    # dashboard and the gateway's metrics): a project said to, not any root
    # project. `cluster up`'s own project ("default") was, and stays.
    [
        "ALTER TABLE projects ADD COLUMN operator BOOLEAN NOT NULL DEFAULT FALSE",
        "UPDATE projects SET operator = TRUE WHERE name = 'default' AND parent IS NULL",
    ],
    # 5: keys that expire or are revoked, and keys made by keys
    # (control/keys.py); the keys made before it do neither until revoked.
    [
        "ALTER TABLE api_keys ADD COLUMN expires_at DOUBLE PRECISION",
        "ALTER TABLE api_keys ADD COLUMN revoked_at DOUBLE PRECISION",
        "ALTER TABLE api_keys ADD COLUMN last_used_at DOUBLE PRECISION",
        "ALTER TABLE api_keys ADD COLUMN note TEXT NOT NULL DEFAULT ''",
        # The key that made it (its hash): revoked with it.
        "ALTER TABLE api_keys ADD COLUMN created_by TEXT",
        "CREATE INDEX api_keys_created_by ON api_keys(created_by)",
        "CREATE INDEX api_keys_project ON api_keys(project)",
    ],
]

VERSION = len(MIGRATIONS)


async def migrate(db: Database) -> int:
    """Bring the schema to VERSION; returns the version found before."""
    async with db.transaction() as tx:
        if tx.dialect == "postgresql":
            await tx.execute("SELECT pg_advisory_xact_lock(7070)")
        await tx.execute("CREATE TABLE IF NOT EXISTS corral_schema (version INTEGER NOT NULL)")
        row = await tx.fetchone("SELECT version FROM corral_schema")
        found = int(row[0]) if row else 0
        if row is None:
            await tx.execute("INSERT INTO corral_schema (version) VALUES (0)")
        if found > VERSION:
            raise Unavailable(
                f"the state store's schema is version {found}, newer than this Corral "
                f"knows ({VERSION}): upgrade Corral"
            )
        for version in range(found + 1, VERSION + 1):
            for statement in MIGRATIONS[version - 1]:
                await tx.execute(statement)
            await tx.execute("UPDATE corral_schema SET version = %s", (version,))
        return found
