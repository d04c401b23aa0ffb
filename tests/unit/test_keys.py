"""API keys (control/keys.py) on SQLite: stored hashed, expiring,
revocable by id or by the key, refused with the reason; a gateway stops
serving a revoked key within RECHECK and an expired one at once; the CLI
makes, lists and revokes them; a store from before migration 5 keeps its
keys working."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

import corral
from corral.api.app import create_app
from corral.api.http import HttpService
from corral.api.models import CreateKey, Event
from corral.control import gateway as gateway_module
from corral.control import keys, quotas, schema
from corral.control.gateway import Gateway
from corral.control.view import GatewayView
from corral.db import Database, connect
from corral.errors import (
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from corral.node.agent import NodeAgent

NOW = 1_700_000_000.0  # 2023-11-14


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[Database]:
    d = await connect(f"sqlite:///{tmp_path}/state.db")
    await schema.migrate(d)
    await quotas.create_project(d, "org")
    yield d
    await d.aclose()


async def _set(db: Database, column: str, value: float | None, key: str) -> None:
    async with db.transaction() as tx:
        await tx.execute(
            f"UPDATE api_keys SET {column} = %s WHERE key_hash = %s", (value, keys.hash_key(key))
        )


async def test_keys_are_stored_hashed_and_name_their_project(db: Database) -> None:
    key, info = await keys.create_key(db, "org", note="ci runner")
    assert (await keys.check_key(db, key)).project == "org"
    async with db.transaction() as tx:
        stored = [r[0] for r in await tx.fetchall("SELECT key_hash FROM api_keys")]
    assert key not in stored and stored == [keys.hash_key(key)]
    assert info.id == stored[0][: keys.ID_LEN] and key not in json.dumps(info.__dict__)
    for bad in ("", "ck_forged", key + "x"):
        with pytest.raises(Unauthenticated, match="a valid API key is required"):
            await keys.check_key(db, bad)
    with pytest.raises(NotFound):
        await keys.create_key(db, "ghost")


async def test_an_expired_key_is_refused_saying_when(db: Database) -> None:
    key, info = await keys.create_key(db, "org", expires_at=time.time() + 3600)
    assert (await keys.check_key(db, key)).expires_at == info.expires_at
    await _set(db, "expires_at", time.time() - 1, key)  # an hour went by
    with pytest.raises(Unauthenticated, match=f"API key {info.id} expired at 20"):
        await keys.check_key(db, key)


async def test_a_key_is_revoked_by_id_or_by_itself_once(db: Database) -> None:
    key, info = await keys.create_key(db, "org")
    other, _ = await keys.create_key(db, "org")
    revoked, also = await keys.revoke_key(db, info.id)
    assert revoked.id == info.id and revoked.revoked_at is not None and also == []
    with pytest.raises(Unauthenticated, match=f"API key {info.id} was revoked at"):
        await keys.check_key(db, key)
    assert (await keys.check_key(db, other)).project == "org"  # its neighbour is untouched
    # Again, and by the key itself (one found leaked): nothing changes.
    assert (await keys.revoke_key(db, key))[0].revoked_at == revoked.revoked_at
    assert (await keys.revoke_key(db, other))[0].revoked_at is not None
    listed = await keys.list_keys(db, "org")
    assert {k.id for k in listed} == {info.id, keys.hash_key(other)[: keys.ID_LEN]}
    assert all(k.revoked_at is not None for k in listed)


@pytest.mark.parametrize(
    ("given", "rule"),
    [
        ("", "must be a key id"),
        ("abc", "must be a key id"),
        ("ABCDEF012345", "must be a key id"),
        ("0123456789ab%", "must be a key id"),  # no LIKE pattern gets through
        ("%", "must be a key id"),
    ],
)
async def test_a_bad_key_to_revoke_names_the_rule(db: Database, given: str, rule: str) -> None:
    await keys.create_key(db, "org")
    with pytest.raises(InvalidArgument, match=rule) as err:
        await keys.revoke_key(db, given)
    assert err.value.field == "key"
    assert all(k.revoked_at is None for k in await keys.list_keys(db))


async def test_an_unknown_key_to_revoke_is_not_found(db: Database) -> None:
    with pytest.raises(NotFound, match="no API key 0123456789ab"):
        await keys.revoke_key(db, "0123456789ab")
    with pytest.raises(NotFound):
        await keys.list_keys(db, "ghost")


async def test_last_use_is_written_at_most_once_a_minute(db: Database) -> None:
    key, _ = await keys.create_key(db, "org")
    assert (await keys.list_keys(db))[0].last_used_at is None
    await keys.check_key(db, key)
    first = (await keys.list_keys(db))[0].last_used_at
    assert first is not None
    await keys.check_key(db, key)
    assert (await keys.list_keys(db))[0].last_used_at == first
    await _set(db, "last_used_at", first - keys.USED_EVERY, key)
    await keys.check_key(db, key)
    assert (await keys.list_keys(db))[0].last_used_at > first - 1  # type: ignore[operator]


@pytest.mark.parametrize(
    ("given", "seconds"),
    [("90m", 5400), ("12h", 43200), ("30d", 30 * 86400), ("2w", 14 * 86400), ("1d12h", 129600),
     (" 1D ", 86400)],
)  # fmt: skip
def test_an_expiry_is_a_duration(given: str, seconds: float) -> None:
    assert keys.parse_expiry(given, now=NOW) == NOW + seconds


def test_an_expiry_is_a_moment_utc_unless_it_says() -> None:
    at = keys.parse_expiry("2027-01-15T08:00:00Z", now=NOW)
    assert keys.moment(at) == "2027-01-15T08:00:00Z"
    assert keys.parse_expiry("2027-01-15T09:00:00+01:00", now=NOW) == at
    assert keys.parse_expiry("2027-01-15T08:00:00", now=NOW) == at
    assert keys.moment(keys.parse_expiry("2027-01-15", now=NOW)) == "2027-01-15T00:00:00Z"


@pytest.mark.parametrize(
    ("given", "rule"),
    [
        ("", "must be a duration"),
        ("30", "must be a duration"),
        ("soon", "must be a duration"),
        ("-1d", "must be a duration"),
        ("1.5d", "must be a duration"),
        ("0s", "must be in the future"),
        ("2020-01-01", "must be in the future"),
        ("40000w", "must be within 100 years"),
        ("9999-12-31", "must be within 100 years"),
    ],
)
def test_a_bad_expiry_names_the_field_and_the_rule(given: str, rule: str) -> None:
    with pytest.raises(InvalidArgument, match=rule) as err:
        keys.parse_expiry(given, now=NOW)
    assert err.value.field == "expires" and err.value.details["value"] == repr(given)


@pytest.mark.parametrize(
    ("field", "kw", "rule"),
    [
        ("note", {"note": "x" * 201}, "at most 200 printable"),
        ("note", {"note": "line\nbreak"}, "at most 200 printable"),
        ("expires_at", {"expires_at": 1.0}, "must be in the future"),
    ],
)
async def test_a_bad_key_request_makes_no_key(
    db: Database, field: str, kw: dict[str, object], rule: str
) -> None:
    with pytest.raises(InvalidArgument, match=rule) as err:
        await keys.create_key(db, "org", **kw)  # type: ignore[arg-type]
    assert err.value.field == field
    assert await keys.list_keys(db) == []


async def test_a_gateway_stops_a_revoked_key_within_recheck_and_an_expired_one_at_once(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    gw = await Gateway(db, node_key=None).start(sweep=False)
    try:
        key, info = await keys.create_key(db, "org")
        assert (await gw.for_token(key)).project == "org"  # type: ignore[attr-defined]
        await keys.revoke_key(db, info.id)
        # Within RECHECK the cache may still serve it; after, never.
        monkeypatch.setattr(keys, "RECHECK", 0.0)
        with pytest.raises(Unauthenticated, match="revoked"):
            await gw.for_token(key)
        monkeypatch.setattr(keys, "RECHECK", 3600.0)
        brief, _ = await keys.create_key(db, "org", expires_at=time.time() + 0.3)
        await gw.for_token(brief)  # cached now, for an hour of RECHECK
        await asyncio.sleep(0.4)
        with pytest.raises(Unauthenticated, match="expired"):
            await gw.for_token(brief)
    finally:
        await gw.aclose()


async def test_a_store_from_before_expiry_keeps_its_keys(tmp_path: Path) -> None:
    d = await connect(f"sqlite:///{tmp_path}/old.db")
    try:
        async with d.transaction() as tx:
            await tx.execute("CREATE TABLE corral_schema (version INTEGER NOT NULL)")
            await tx.execute("INSERT INTO corral_schema (version) VALUES (0)")
            for version in range(4):
                for statement in schema.MIGRATIONS[version]:
                    await tx.execute(statement)
            await tx.execute("UPDATE corral_schema SET version = 4")
            await tx.execute(
                "INSERT INTO projects (name, created_at) VALUES ('old', 0)",
            )
            await tx.execute(
                "INSERT INTO api_keys (key_hash, project, created_at) VALUES (%s, 'old', 0)",
                (keys.hash_key("ck_from-last-year"),),
            )
        assert await schema.migrate(d) == 4
        assert (await keys.check_key(d, "ck_from-last-year")).expires_at is None
        (listed,) = await keys.list_keys(d)
        assert listed.note == "" and listed.revoked_at is None
    finally:
        await d.aclose()


def _cli(state: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "corral.cli.main", "--json", "project", *args, "--state", state],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_cli_makes_lists_and_revokes_keys(tmp_path: Path) -> None:
    state = f"sqlite:///{tmp_path}/cli.db"
    assert _cli(state, "create", "acme").returncode == 0
    made = _cli(state, "key", "acme", "--expires", "30d", "--note", "ci")
    assert made.returncode == 0, made.stderr
    doc = json.loads(made.stdout)
    assert doc["api_key"].startswith("ck_") and doc["note"] == "ci"
    assert 29.9 * 86400 < doc["expires_at"] - time.time() <= 30 * 86400
    (row,) = json.loads(_cli(state, "keys", "acme").stdout)
    assert row["id"] == doc["id"] and "api_key" not in row
    gone = _cli(state, "revoke", doc["id"])
    assert gone.returncode == 0 and json.loads(gone.stdout)["revoked_at"] is not None
    bad = _cli(state, "key", "acme", "--expires", "yesterday")
    assert bad.returncode != 0 and "expires" in bad.stderr and "yesterday" in bad.stderr
    assert len(json.loads(_cli(state, "keys").stdout)) == 1


# ------------------------------------------------- managed by their holders


@pytest.fixture
async def tree(db: Database) -> AsyncIterator[tuple[Gateway, dict[str, str]]]:
    """org > team > job, and other-org; a key of each; a real gateway."""
    await quotas.create_project(db, "team", parent="org")
    await quotas.create_project(db, "job", parent="team")
    await quotas.create_project(db, "other-org")
    gw = await Gateway(db, node_key=None).start(sweep=False)
    made = {p: (await keys.create_key(db, p))[0] for p in ("org", "team", "job", "other-org")}
    yield gw, made
    await gw.aclose()


def _client(gw: Gateway, key: str) -> corral.AsyncClient:
    app = create_app(None, for_token=gw.for_token, for_sandbox=gw.for_sandbox)
    http = HttpService("http://gw", api_key=key, transport=httpx.ASGITransport(app=app))
    return corral.AsyncClient(transport=http)


async def test_a_key_makes_lists_and_revokes_keys_of_its_subtree_only(
    tree: tuple[Gateway, dict[str, str]],
) -> None:
    gw, made = tree
    async with _client(gw, made["team"]) as team:
        child = await team.keys.create(project="job", expires="1h", note="run 7")
        assert child.api_key and child.project == "job" and child.note == "run 7"
        assert child.expires_at is not None and 3590 < child.expires_at - time.time() <= 3600
        assert (await gw.for_token(child.api_key)).project == "job"  # type: ignore[attr-defined]
        listed = await team.keys.list()
        assert {k.project for k in listed} == {"team", "job"}
        assert all(k.api_key is None for k in listed)  # never the keys themselves
        assert [k.id for k in await team.keys.list("job")][-1] == child.id
        for outside in ("org", "other-org", "ghost"):
            with pytest.raises(NotFound, match=f"no project '{outside}'"):
                await team.keys.create(project=outside)
            with pytest.raises(NotFound, match=f"no project '{outside}'"):
                await team.keys.list(outside)
        # Another subtree's key, by its id: as if it did not exist.
        theirs = keys.hash_key(made["other-org"])[: keys.ID_LEN]
        with pytest.raises(NotFound, match=f"no API key {theirs}"):
            await team.keys.revoke(theirs)
        assert (await gw.for_token(made["other-org"])).project == "other-org"  # type: ignore[attr-defined]
        gone = await team.keys.revoke(child.id)
        assert gone.revoked_at is not None
    with pytest.raises(Unauthenticated, match="revoked"):
        await gw.for_token(child.api_key)


async def test_a_key_that_expires_makes_none_that_outlives_it(
    tree: tuple[Gateway, dict[str, str]], db: Database
) -> None:
    gw, _ = tree
    brief, info = await keys.create_key(db, "team", expires_at=time.time() + 600)
    async with _client(gw, brief) as team:
        with pytest.raises(InvalidArgument, match="must not outlive the key") as err:
            await team.keys.create(project="job", expires="1h")
        assert err.value.field == "expires_in"
        inherited = await team.keys.create(project="job")
        assert inherited.expires_at == info.expires_at
        shorter = await team.keys.create(expires=60)
        assert shorter.expires_at is not None and shorter.expires_at < info.expires_at  # type: ignore[operator]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"note": "two\nlines"}, "note"),
        ({"note": "x" * 201}, "note"),
        ({"expires": 0}, "expires_in"),
        ({"expires": -5}, "expires_in"),
        ({"expires": 4e9}, "expires_in"),
        ({"expires": "soon"}, "expires"),
        ({"expires": "30"}, "expires"),
        ({"project": ""}, "project"),
    ],
)
async def test_a_bad_key_request_over_the_wire_makes_no_key(
    tree: tuple[Gateway, dict[str, str]], kw: dict[str, object], field: str
) -> None:
    gw, made = tree
    before = len(await keys.list_keys(gw.db))
    async with _client(gw, made["team"]) as team:
        with pytest.raises(InvalidArgument) as err:
            await team.keys.create(**kw)  # type: ignore[arg-type]
    assert err.value.field == field
    assert len(await keys.list_keys(gw.db)) == before


async def test_a_key_is_never_revoked_by_itself_over_the_wire(
    tree: tuple[Gateway, dict[str, str]],
) -> None:
    """URLs are logged: a key in one would leak it. Revoke by id."""
    gw, made = tree
    async with _client(gw, made["team"]) as team:
        with pytest.raises(InvalidArgument, match="not the key") as err:
            await team.keys.revoke(made["job"])  # the SDK does not send it
        assert err.value.field == "key_id" and made["job"] not in str(err.value)
        with pytest.raises(InvalidArgument, match="never sent") as err:
            await team.service.revoke_key(made["job"])  # another client did
        assert err.value.field == "key" and made["job"] not in str(err.value)
    assert (await gw.for_token(made["job"])).project == "job"  # type: ignore[attr-defined]


async def test_keys_are_not_managed_with_a_sandboxs_token_or_on_a_node(
    tree: tuple[Gateway, dict[str, str]],
) -> None:
    gw, _ = tree
    with pytest.raises(Unauthenticated, match="with an API key"):
        await GatewayView(gw, "team").create_key(CreateKey())
    with pytest.raises(Unavailable, match="a cluster gateway's"):
        await NodeAgent.create_key(None, CreateKey())  # type: ignore[arg-type]


async def test_revoking_a_key_revokes_every_key_made_from_it(
    tree: tuple[Gateway, dict[str, str]], db: Database
) -> None:
    """A leaked key that minted itself spares is revoked with its spares."""
    gw, made = tree
    async with _client(gw, made["team"]) as team:
        child = await team.keys.create(project="job", note="child")
    assert child.api_key is not None and child.created_by == keys.hash_key(made["team"])[:12]
    async with _client(gw, child.api_key) as job:
        grandchild = await job.keys.create(note="grandchild")
    assert grandchild.api_key is not None and grandchild.created_by == child.id
    sibling, _ = await keys.create_key(db, "job")  # the operator's: not from the team's key
    team_id = keys.hash_key(made["team"])[: keys.ID_LEN]
    info, also = await keys.revoke_key(db, team_id)
    assert info.id == team_id and sorted(also) == sorted([child.id, grandchild.id])
    for gone in (made["team"], child.api_key, grandchild.api_key):
        with pytest.raises(Unauthenticated, match="revoked"):
            await keys.check_key(db, gone)
    assert (await keys.check_key(db, sibling)).project == "job"
    # Through a gateway, the answer says which went with it, and that
    # gateway stops them all at once.
    async with _client(gw, made["org"]) as org:
        again = await org.keys.create(project="job")
        assert again.api_key is not None
        async with _client(gw, again.api_key) as job:
            spare = await job.keys.create()
        assert spare.api_key is not None
        await gw.for_token(spare.api_key)  # in this gateway's cache now
        answer = await org.keys.revoke(again.id)
        assert answer.also_revoked == [spare.id]
    with pytest.raises(Unauthenticated, match="revoked"):
        await gw.for_token(spare.api_key)


async def test_a_project_holds_at_most_keys_max_live_keys(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keys, "KEYS_MAX", 3)
    held = [(await keys.create_key(db, "org"))[1] for _ in range(3)]
    with pytest.raises(ResourceExhausted, match="holds 3 live API keys") as err:
        await keys.create_key(db, "org")
    assert err.value.details["resource"] == "api_keys" and len(await keys.list_keys(db)) == 3
    await keys.revoke_key(db, held[0].id)  # a revoked key is not live
    await keys.create_key(db, "org")
    assert len(await keys.list_keys(db)) == 4


async def test_a_gateway_keeps_a_bounded_cache_of_hashes_not_keys(
    tree: tuple[Gateway, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    gw, made = tree
    monkeypatch.setattr(gateway_module, "KEYS_SEEN", 2)
    for key in made.values():
        await gw.for_token(key)
    assert len(gw.keys_seen) == 2
    assert not set(made.values()) & set(gw.keys_seen)  # hashes only
    assert set(gw.keys_seen) == {keys.hash_key(made["job"]), keys.hash_key(made["other-org"])}


async def test_an_event_stream_ends_at_its_first_event_after_its_key_is_revoked(
    tree: tuple[Gateway, dict[str, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request's key is checked once; a stream may run for days."""
    gw, made = tree
    monkeypatch.setattr(keys, "RECHECK", 0.0)
    view = await gw.for_token(made["team"])
    closed = []

    async def source() -> AsyncIterator[Event]:
        try:
            for i in range(10):
                yield Event(kind="state", at=float(i), sandbox=f"s{i}")
        finally:
            closed.append(True)

    stream = view._rechecked(source())  # type: ignore[attr-defined]
    assert (await anext(stream)).sandbox == "s0"
    await keys.revoke_key(gw.db, keys.hash_key(made["team"])[: keys.ID_LEN])
    with pytest.raises(Unauthenticated, match="revoked"):
        await anext(stream)
    assert closed == [True]


async def test_a_token_a_key_asks_for_ends_with_the_key(
    tree: tuple[Gateway, dict[str, str]],
) -> None:
    """A direct token is checked by a node without the key: it must not
    outlive a key that expires first."""
    gw, _ = tree
    brief = GatewayView(gw, "team", keys.Grant("team", time.time() + 100, "h"))
    assert 98 <= brief._within_key(300) <= 100
    assert brief._within_key(30) == 30
    assert GatewayView(gw, "team", keys.Grant("team", None, "h"))._within_key(300) == 300
    assert GatewayView(gw, "team", keys.Grant("team", time.time() + 0.2, "h"))._within_key(60) == 1


async def test_a_key_revoked_while_a_mint_is_in_flight_makes_no_spare(
    tree: tuple[Gateway, dict[str, str]], db: Database
) -> None:
    """A gateway may hold a grant for up to RECHECK after a revocation
    (another gateway's): the mint reads its maker again where it writes."""
    _, made = tree
    grant = await keys.check_key(db, made["team"])  # what a gateway cached
    await keys.revoke_key(db, keys.hash_key(made["team"])[: keys.ID_LEN])
    before = len(await keys.list_keys(db))
    with pytest.raises(Unauthenticated, match="was revoked"):
        await keys.mint(db, grant, "job", None, "spare")
    assert len(await keys.list_keys(db)) == before


async def test_revocation_follows_a_line_however_deep(db: Database) -> None:
    """65 keys each made by the last: revoking the first revokes them all."""
    first, info = await keys.create_key(db, "org")
    maker, line = keys.hash_key(first), []
    for _ in range(65):
        key, child = await keys.create_key(db, "org", made_by=maker)
        maker = keys.hash_key(key)
        line.append(child.id)
    _, also = await keys.revoke_key(db, info.id)
    assert sorted(also) == sorted(line)
    with pytest.raises(Unauthenticated, match="revoked"):
        await keys.check_hash(db, maker)


async def test_an_event_stream_says_why_it_ended(tree: tuple[Gateway, dict[str, str]]) -> None:
    """Over HTTP a stream that ends on an error sends it as its last event
    (event: error), and the SDK raises it: not a dropped connection."""
    gw, made = tree

    class Events:
        async def events_of(self) -> AsyncIterator[Event]:
            yield Event(kind="state", at=1.0, sandbox="s0")
            raise Unauthenticated("API key 0123456789ab was revoked at 2026-12-07T10:00:00Z")

    from corral.api.serving import sse_stream

    app = create_app(None, for_token=gw.for_token)
    app.get("/stream")(lambda: sse_stream(Events().events_of()))
    http = HttpService("http://gw", api_key=made["team"], transport=httpx.ASGITransport(app=app))
    got = []
    with pytest.raises(Unauthenticated, match="was revoked"):
        async for event in http._sse("/stream", []):
            got.append(event.sandbox)
    assert got == ["s0"]
    await http.aclose()
