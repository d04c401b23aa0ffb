"""API keys: each belongs to one project, is shown once and stored hashed,
and may expire (`expires_at`) or be revoked. A key is named in listings and
revocations by its id, the first 12 hex digits of its hash: enough to tell
keys apart, useless for finding the key.

A gateway re-checks a key it has seen at most every RECHECK seconds
(control/gateway.py), so a revocation takes effect on every gateway within
that; an expiry takes effect at its second, cache or not.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from corral.db import Database
from corral.errors import InvalidArgument, NotFound, Unauthenticated

RECHECK = 5.0
# last_used_at is written at most this often per key: a request's check is a
# read, and a busy key costs one write a minute, not one a request.
USED_EVERY = 60.0
ID_LEN = 12
NOTE_MAX = 200
MAX_LIFE = 100 * 365 * 86400  # beyond it, a date is a typo (and past year 9999, not a date)
_DURATION = re.compile(r"(\d+)\s*([smhdw])")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
EXPIRY_RULE = "must be a duration like '90m', '12h', '30d' or '8w', or an ISO date/time"
MISSING = "a valid API key is required: Authorization: Bearer <key>"


@dataclass(frozen=True)
class KeyInfo:
    id: str
    project: str
    created_at: float
    expires_at: float | None
    revoked_at: float | None
    last_used_at: float | None
    note: str


_COLUMNS = "key_hash, project, created_at, expires_at, revoked_at, last_used_at, note"


def _info(row: tuple[object, ...]) -> KeyInfo:
    h, project, created, expires, revoked, used, note = row
    return KeyInfo(
        str(h)[:ID_LEN],
        str(project),
        float(created),  # type: ignore[arg-type]
        None if expires is None else float(expires),  # type: ignore[arg-type]
        None if revoked is None else float(revoked),  # type: ignore[arg-type]
        None if used is None else float(used),  # type: ignore[arg-type]
        "" if note is None else str(note),
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
    text = value.strip().lower()
    if text and _DURATION.sub("", text).strip() == "":
        at = now + sum(int(n) * _SECONDS[u] for n, u in _DURATION.findall(text))
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
    db: Database, project: str, *, expires_at: float | None = None, note: str = ""
) -> tuple[str, KeyInfo]:
    """A new API key for `project` (shown once; stored hashed) and its
    listing."""
    now = time.time()
    if expires_at is not None:
        _check_expiry(expires_at, now, "expires_at", expires_at)
    if len(note) > NOTE_MAX or not note.isprintable():
        raise InvalidArgument("note", f"must be at most {NOTE_MAX} printable characters", note)
    key = "ck_" + secrets.token_urlsafe(24)
    async with db.transaction() as tx:
        if not await tx.fetchone("SELECT 1 FROM projects WHERE name = %s", (project,)):
            raise NotFound(f"no project {project!r}", project=project)
        await tx.execute(
            "INSERT INTO api_keys (key_hash, project, created_at, expires_at, note)"
            " VALUES (%s, %s, %s, %s, %s)",
            (hash_key(key), project, now, expires_at, note),
        )
    return key, KeyInfo(hash_key(key)[:ID_LEN], project, now, expires_at, None, None, note)


@dataclass(frozen=True)
class Grant:
    """What a checked key opens: its project, until `expires_at`."""

    project: str
    expires_at: float | None

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at


async def check_key(db: Database, key: str) -> Grant:
    """The grant of `key`, or Unauthenticated saying why not (unknown,
    revoked, expired). Telling the holder of a real key that it was revoked
    or expired tells them nothing they could not guess, and saves a support
    ticket."""
    if not key:
        raise Unauthenticated(MISSING)
    h = hash_key(key)
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
        grant = Grant(str(project), None if expires is None else float(expires))
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


async def revoke_key(db: Database, which: str) -> KeyInfo:
    """Revoke the key named by its id (or by the key itself, for one found
    leaked). Revoking a revoked key changes nothing and is not an error."""
    if which.startswith("ck_"):
        prefix = hash_key(which)[:ID_LEN]
    elif re.fullmatch(f"[0-9a-f]{{{ID_LEN}}}", which):
        prefix = which
    else:
        raise InvalidArgument("key", f"must be a key id ({ID_LEN} hex digits) or a key", which)
    async with db.transaction() as tx:
        rows = await tx.fetchall(
            f"SELECT {_COLUMNS} FROM api_keys WHERE key_hash LIKE %s", (prefix + "%",)
        )
        if not rows:
            raise NotFound(f"no API key {prefix}", key=prefix)
        if len(rows) > 1:  # 48 bits: not in practice, but never revoke a guess
            raise InvalidArgument("key", "names more than one key: give the key itself", which)
        info = _info(rows[0])
        if info.revoked_at is None:
            now = time.time()
            await tx.execute(
                "UPDATE api_keys SET revoked_at = %s WHERE key_hash = %s", (now, rows[0][0])
            )
            info = KeyInfo(**{**info.__dict__, "revoked_at": now})
    return info
