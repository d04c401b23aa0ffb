"""API keys: each belongs to one project, is shown once and stored hashed,
and may expire (`expires_at`) or be revoked. A key is named in listings and
revocations by its id, the first 12 hex digits of its hash: enough to tell
keys apart, useless for finding the key.

A gateway re-checks a key it has seen at most every RECHECK seconds
(control/gateway.py), so a revocation takes effect on every gateway within
that; an expiry takes effect at its second, cache or not.

A key may make keys (for its project or those below it, through a
gateway): each records its maker (`created_by`), and revoking a key revokes
every key made from it, down the line, in the same transaction. So a
leaked key that minted itself a spare is revoked with its spare.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from corral.api.models_keys import MAX_LIFE, NOTE_MAX
from corral.control import quotas
from corral.db import Database
from corral.errors import InvalidArgument, NotFound, ResourceExhausted, Unauthenticated
from corral.units import parse_duration

RECHECK = 5.0
# last_used_at is written at most this often per key: a request's check is a
# read, and a busy key costs one write a minute, not one a request.
USED_EVERY = 60.0
ID_LEN = 12
EXPIRY_RULE = "must be a duration like '90m', '12h', '30d' or '8w', or an ISO date/time"
KEY_ID_RULE = f"must be a key id ({ID_LEN} hex digits, from `corral project keys`)"
MISSING = "a valid API key is required: Authorization: Bearer <key>"
# Live keys (neither revoked nor expired) a project may hold: keys made by
# keys are made by programs, and a loop must not fill the store.
KEYS_MAX = 1000


@dataclass(frozen=True)
class KeyInfo:
    id: str
    project: str
    created_at: float
    expires_at: float | None
    revoked_at: float | None
    last_used_at: float | None
    note: str
    created_by: str | None = None  # the id of the key that made it (None: the CLI)


_COLUMNS = "key_hash, project, created_at, expires_at, revoked_at, last_used_at, note, created_by"


def _info(row: tuple[object, ...]) -> KeyInfo:
    h, project, created, expires, revoked, used, note, made_by = row
    return KeyInfo(
        str(h)[:ID_LEN],
        str(project),
        float(created),  # type: ignore[arg-type]
        None if expires is None else float(expires),  # type: ignore[arg-type]
        None if revoked is None else float(revoked),  # type: ignore[arg-type]
        None if used is None else float(used),  # type: ignore[arg-type]
        "" if note is None else str(note),
        None if made_by is None else str(made_by)[:ID_LEN],
    )


def hash_key(key: str) -> str:
    """Keys are stored hashed: a leaked database does not leak keys."""
    return hashlib.sha256(key.encode()).hexdigest()


def moment(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def parse_expiry(value: str, *, now: float, field: str = "expires") -> float:
    """When a key given `value` expires: a duration from `now` ('30d',
    '1d12h') or a moment (ISO 8601; UTC unless it says otherwise). It must
    be in the future."""
    seconds = parse_duration(value)
    if seconds is not None:
        at = now + seconds
    else:
        try:
            parsed = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
        except ValueError:
            raise InvalidArgument(field, EXPIRY_RULE, value) from None
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=UTC)
        at = parsed.timestamp()
    _check_expiry(at, now, field, value)
    return at


def _check_expiry(at: float, now: float, field: str, given: object) -> None:
    if at <= now:
        raise InvalidArgument(field, "must be in the future", given)
    if at - now > MAX_LIFE:
        raise InvalidArgument(field, "must be within 100 years", given)


async def create_key(
    db: Database,
    project: str,
    *,
    expires_at: float | None = None,
    note: str = "",
    made_by: str | None = None,
) -> tuple[str, KeyInfo]:
    """A new API key for `project` (shown once; stored hashed) and its
    listing; `made_by`: the hash of the key that asked for it."""
    now = time.time()
    if expires_at is not None:
        _check_expiry(expires_at, now, "expires_at", expires_at)
    if len(note) > NOTE_MAX or not note.isprintable():
        raise InvalidArgument("note", f"must be at most {NOTE_MAX} printable characters", note)
    key = "ck_" + secrets.token_urlsafe(24)
    async with db.transaction() as tx:
        if not await tx.fetchone("SELECT 1 FROM projects WHERE name = %s", (project,)):
            raise NotFound(f"no project {project!r}", project=project)
        live = await tx.fetchone(
            "SELECT COUNT(*) FROM api_keys WHERE project = %s AND revoked_at IS NULL"
            " AND (expires_at IS NULL OR expires_at > %s)",
            (project, now),
        )
        if made_by is not None:
            # The maker, read again where the new key is written (locked on
            # PostgreSQL): a revocation that committed first is seen, and
            # one that comes after waits for this key and revokes it too.
            maker = await tx.fetchone(
                "SELECT revoked_at, expires_at FROM api_keys WHERE key_hash = %s" + tx.for_update(),
                (made_by,),
            )
            if maker is None or maker[0] is not None:
                raise Unauthenticated(f"API key {made_by[:ID_LEN]} was revoked")
            if maker[1] is not None and float(maker[1]) <= now:
                raise Unauthenticated(f"API key {made_by[:ID_LEN]} expired")
        if live and int(live[0]) >= KEYS_MAX:
            raise ResourceExhausted(
                f"project {project!r} holds {KEYS_MAX} live API keys: revoke some first",
                project=project, resource="api_keys", limit=KEYS_MAX,
            )  # fmt: skip
        await tx.execute(
            "INSERT INTO api_keys (key_hash, project, created_at, expires_at, note, created_by)"
            " VALUES (%s, %s, %s, %s, %s, %s)",
            (hash_key(key), project, now, expires_at, note, made_by),
        )
    made = None if made_by is None else made_by[:ID_LEN]
    return key, KeyInfo(hash_key(key)[:ID_LEN], project, now, expires_at, None, None, note, made)


@dataclass(frozen=True)
class Grant:
    """What a checked key opens: its project, until `expires_at`
    (`key_hash`: which key, to check it again without holding it)."""

    project: str
    expires_at: float | None
    key_hash: str

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


async def check_key(db: Database, key: str) -> Grant:
    """The grant of `key`, or Unauthenticated saying why not (unknown,
    revoked, expired). Telling the holder of a real key that it was revoked
    or expired tells them nothing they could not guess, and saves a support
    ticket."""
    if not key:
        raise Unauthenticated(MISSING)
    return await check_hash(db, hash_key(key))


async def check_hash(db: Database, h: str) -> Grant:
    """check_key of the key whose hash is `h` (a stream's grant, again)."""
    now = time.time()
    async with db.transaction() as tx:
        row = await tx.fetchone(
            "SELECT project, expires_at, revoked_at, last_used_at FROM api_keys"
            " WHERE key_hash = %s",
            (h,),
        )
        if row is None:
            raise Unauthenticated(MISSING)
        project, expires, revoked, used = row
        if revoked is not None:
            raise Unauthenticated(f"API key {h[:ID_LEN]} was revoked at {moment(float(revoked))}")
        grant = Grant(str(project), None if expires is None else float(expires), h)
        if grant.expired(now):
            assert grant.expires_at is not None
            raise Unauthenticated(f"API key {h[:ID_LEN]} expired at {moment(grant.expires_at)}")
        if used is None or now - float(used) >= USED_EVERY:
            await tx.execute("UPDATE api_keys SET last_used_at = %s WHERE key_hash = %s", (now, h))
    return grant


async def list_keys(db: Database, project: str | None = None) -> list[KeyInfo]:
    """Every key (of `project` only, if given), oldest first; never the keys."""
    where, args = ("WHERE project = %s", (project,)) if project else ("", ())
    async with db.transaction() as tx:
        if project and not await tx.fetchone("SELECT 1 FROM projects WHERE name = %s", args):
            raise NotFound(f"no project {project!r}", project=project)
        rows = await tx.fetchall(
            f"SELECT {_COLUMNS} FROM api_keys {where} ORDER BY created_at, key_hash", args
        )
    return [_info(r) for r in rows]


async def revoke_key(
    db: Database, which: str, *, within: str | None = None
) -> tuple[KeyInfo, list[str]]:
    """Revoke the key named by its id (or by the key itself, for one found
    leaked), and every key made from it: its listing, and the ids of those
    others revoked now. Revoking a revoked key changes nothing and is not an
    error. `within`: a key holder's project; a key outside it answers as
    one that does not exist."""
    if which.startswith("ck_"):
        if within is not None:  # over the wire, in a URL: logs and traces would keep it
            raise InvalidArgument("key", KEY_ID_RULE + " (a key itself is never sent)", "ck_...")
        prefix = hash_key(which)[:ID_LEN]
    elif re.fullmatch(f"[0-9a-f]{{{ID_LEN}}}", which):
        prefix = which
    else:
        more = " or a key" if within is None else ""
        raise InvalidArgument("key", KEY_ID_RULE + more, which)
    async with db.transaction() as tx:
        rows = await tx.fetchall(
            f"SELECT {_COLUMNS} FROM api_keys WHERE key_hash LIKE %s", (prefix + "%",)
        )
        if within is not None:
            rows = [r for r in rows if within in await quotas.ancestors(tx, str(r[1]))]
        if not rows:
            raise NotFound(f"no API key {prefix}", key=prefix)
        if len(rows) > 1:  # 48 bits: not in practice, but never revoke a guess
            raise InvalidArgument("key", "names more than one key: give the key itself", which)
        info = _info(rows[0])
        now = time.time()
        if info.revoked_at is None:
            await tx.execute(
                "UPDATE api_keys SET revoked_at = %s WHERE key_hash = %s", (now, rows[0][0])
            )
            info = KeyInfo(**{**info.__dict__, "revoked_at": now})
        # Its whole line, however deep, even when it was revoked before (a
        # key left live under it stays revocable). A key's maker is older
        # than it, so the walk ends; UNION keeps any row from coming twice.
        line = await tx.fetchall(
            "WITH RECURSIVE line(h) AS ("
            " SELECT key_hash FROM api_keys WHERE created_by = %s"
            " UNION SELECT a.key_hash FROM api_keys a JOIN line l ON a.created_by = l.h)"
            " SELECT h FROM line",
            (rows[0][0],),
        )
        hashes = [str(r[0]) for r in line]
        also: list[str] = []
        for h in hashes:
            done = await tx.fetchall(
                "UPDATE api_keys SET revoked_at = %s WHERE key_hash = %s"
                " AND revoked_at IS NULL RETURNING key_hash",
                (now, h),
            )
            also += [str(r[0])[:ID_LEN] for r in done]
    return info, also


# ------------------------------------------------------- by a key's holder


async def _check_within(db: Database, caller: str, project: str) -> None:
    """`project` is the caller's or below it; any other answers as a project
    that does not exist (names cannot be probed across projects)."""
    async with db.transaction() as tx:
        try:
            chain = await quotas.ancestors(tx, project)
        except NotFound:
            chain = []
    if caller not in chain:
        raise NotFound(f"no project {project!r}", project=project)


async def mint(
    db: Database, caller: Grant, project: str | None, expires_in: float | None, note: str
) -> tuple[str, KeyInfo]:
    """A key made by the holder of `caller`'s key: for its project or one
    below it, never outliving the caller's own key (a key that expires in an
    hour could otherwise make one that never does), and revoked with it."""
    target = project or caller.project
    await _check_within(db, caller.project, target)
    expires_at = None if expires_in is None else time.time() + expires_in
    if caller.expires_at is not None:
        if expires_at is None:
            expires_at = caller.expires_at
        elif expires_at > caller.expires_at:
            until = moment(caller.expires_at)
            rule = f"must not outlive the key that makes it (it expires at {until})"
            raise InvalidArgument("expires_in", rule, expires_in)
    return await create_key(db, target, expires_at=expires_at, note=note, made_by=caller.key_hash)


async def list_within(db: Database, caller: str, project: str = "") -> list[KeyInfo]:
    """The keys of `caller`'s project and every project below it (of
    `project` only, if given)."""
    if project:
        await _check_within(db, caller, project)
        return await list_keys(db, project)
    async with db.transaction() as tx:
        rows = await tx.fetchall(
            "WITH RECURSIVE sub(name, depth) AS ("
            " SELECT name, 0 FROM projects WHERE name = %s"
            " UNION ALL SELECT p.name, s.depth + 1 FROM projects p"
            f" JOIN sub s ON p.parent = s.name WHERE s.depth < {quotas.MAX_DEPTH})"
            f" SELECT {_COLUMNS} FROM api_keys WHERE project IN (SELECT name FROM sub)"
            " ORDER BY created_at, key_hash",
            (caller,),
        )
    return [_info(r) for r in rows]
