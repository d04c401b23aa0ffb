"""The control plane's database: SQLite embedded, PostgreSQL in a cluster.

One small async interface over both, so every query in control/ is written
once. Queries use ``%s`` placeholders (psycopg's); the SQLite side rewrites
them to ``?``. ``$NOW`` in a query is the database's own clock in seconds
since the epoch: heartbeats and their deadlines are compared on one clock,
whichever host wrote them.

Invariant: a transaction is the only way to touch the database, and it is
all-or-nothing (SQLite: BEGIN IMMEDIATE on one connection; PostgreSQL: a
pooled connection's transaction). ``for_update`` adds ``FOR UPDATE`` where
the database has row locks; SQLite's whole-database write lock covers it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sqlite3
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from corral.errors import InvalidArgument, Unavailable

Row = tuple[Any, ...]
T = TypeVar("T")
_PG_NOW = "EXTRACT(EPOCH FROM clock_timestamp())::double precision"
_SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"


class Tx(Protocol):
    dialect: str

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> int: ...

    async def fetchone(self, sql: str, params: Sequence[Any] = ()) -> Row | None: ...

    async def fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[Row]: ...

    def for_update(self) -> str: ...


class Database(Protocol):
    url: str
    dialect: str

    def transaction(self) -> contextlib.AbstractAsyncContextManager[Tx]: ...

    async def aclose(self) -> None: ...


async def connect(url: str) -> Database:
    """``sqlite:///abs/path.db`` or ``postgresql://user@host:port/db``."""
    if url.startswith("sqlite:///"):
        return SqliteDatabase(url)
    if url.startswith(("postgresql://", "postgres://")):
        db = PostgresDatabase(url)
        await db.open()
        return db
    raise InvalidArgument("state", "must be sqlite:///PATH or postgresql://...", url)


class _SqliteTx:
    dialect = "sqlite"

    def __init__(self, conn: sqlite3.Connection, inline: bool) -> None:
        self._conn = conn
        self._inline = inline

    def _sql(self, sql: str) -> str:
        return sql.replace("$NOW", _SQLITE_NOW).replace("%s", "?")

    async def _run(self, fn: Callable[[], T]) -> T:
        return fn() if self._inline else await asyncio.to_thread(fn)

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        return await self._run(lambda: self._conn.execute(self._sql(sql), tuple(params)).rowcount)

    async def fetchone(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        def run() -> Row | None:
            row = self._conn.execute(self._sql(sql), tuple(params)).fetchone()
            return tuple(row) if row is not None else None

        return await self._run(run)

    async def fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        def run() -> list[Row]:
            return [tuple(r) for r in self._conn.execute(self._sql(sql), tuple(params))]

        return await self._run(run)

    def for_update(self) -> str:
        return ""


class SqliteDatabase:
    """One connection, one transaction at a time (an asyncio lock), WAL.
    `inline`: statements run on the event loop's thread, for a caller whose
    statements are all short (a thread hop costs more than they do)."""

    dialect = "sqlite"

    def __init__(self, url: str, *, inline: bool = False) -> None:
        self.url = url
        self._inline = inline
        path = Path(url.removeprefix("sqlite://"))
        path.parent.mkdir(parents=True, exist_ok=True)
        self._conn = sqlite3.connect(
            path, isolation_level=None, check_same_thread=False, timeout=30
        )
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA busy_timeout=30000")
        self._lock = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Tx]:
        async with self._lock:
            tx = _SqliteTx(self._conn, self._inline)
            await tx.execute("BEGIN IMMEDIATE")
            try:
                yield tx
            except BaseException:
                await tx.execute("ROLLBACK")
                raise
            await tx.execute("COMMIT")

    async def aclose(self) -> None:
        self._conn.close()


class _PgTx:
    dialect = "postgresql"

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    async def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        cur = await self._conn.execute(sql.replace("$NOW", _PG_NOW), tuple(params))
        return int(cur.rowcount)

    async def fetchone(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        cur = await self._conn.execute(sql.replace("$NOW", _PG_NOW), tuple(params))
        row = await cur.fetchone()
        return tuple(row) if row is not None else None

    async def fetchall(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        cur = await self._conn.execute(sql.replace("$NOW", _PG_NOW), tuple(params))
        return [tuple(r) for r in await cur.fetchall()]

    def for_update(self) -> str:
        return " FOR UPDATE"


# A connection whose peer vanished (a failover, a dropped NAT or conntrack
# entry) is noticed in seconds, not after the kernel's ~15 minutes of
# retransmissions: unacknowledged data gives up after tcp_user_timeout,
# and an idle connection is probed. libpq ignores both on a unix socket.
TCP_LIVENESS: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
}


class PostgresDatabase:
    """A connection pool. A transaction that loses its connection (the
    server restarted) raises Unavailable: the caller retries the request,
    and every write in control/ is safe to retry."""

    dialect = "postgresql"

    def __init__(self, url: str, max_size: int = 16) -> None:
        from psycopg_pool import AsyncConnectionPool

        self.url = url
        self._pool = AsyncConnectionPool(
            url,
            min_size=1,
            max_size=max_size,
            open=False,
            timeout=15,
            check=AsyncConnectionPool.check_connection,
            kwargs=TCP_LIVENESS,
        )

    async def open(self) -> None:
        try:
            await self._pool.open(wait=True, timeout=15)
        except Exception as exc:
            await self._pool.close()
            raise Unavailable(f"PostgreSQL at {_redact(self.url)} unreachable: {exc}") from exc

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Tx]:
        import psycopg

        try:
            async with self._pool.connection() as conn, conn.transaction():
                yield _PgTx(conn)
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            raise Unavailable(f"the state store is unavailable: {exc}", retry=True) from exc
        except Exception as exc:
            from psycopg_pool import PoolTimeout

            if isinstance(exc, PoolTimeout):
                raise Unavailable(f"the state store is unavailable: {exc}", retry=True) from exc
            raise

    async def aclose(self) -> None:
        await self._pool.close()


def _redact(url: str) -> str:
    return re.sub(r"://([^:@/]+):[^@/]*@", r"://\1:***@", url)
