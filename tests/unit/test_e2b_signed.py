"""E2B's signed file URLs (api/compat/e2b/signed.py): the signature the
stock SDK makes is the one Corral checks, and a signature answers for
its own path, operation, user, sandbox and time alone."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.datastructures import QueryParams

from corral import labels
from corral.api.compat.e2b import envd, signed
from corral.api.compat.e2b.connect import ConnectError

pytestmark = pytest.mark.unit
e2b_signature = pytest.importorskip(
    "e2b.sandbox.signature", reason="the e2b package (a dev dependency) is not installed"
)


def _sbx(sandbox_id: str, token: str | None) -> Any:
    tags = {} if token is None else {labels.E2B_TOKEN: token}
    return SimpleNamespace(id=sandbox_id, labels=tags)


SANDBOXES = [_sbx("a", None), _sbx("b", "tok-b"), _sbx("c", "tok-c")]


def _query(path: str, op: str, user: str | None, token: str, expires_in: int | None) -> QueryParams:
    sig = e2b_signature.get_signature(path, op, user, token, expires_in)
    q = {"path": path, "signature": sig["signature"]}
    if user:
        q["username"] = user
    if sig["expiration"] is not None:
        q["signature_expiration"] = str(sig["expiration"])
    return QueryParams(q)


@pytest.mark.parametrize(
    ("path", "op", "user", "expires_in"),
    [
        ("notes.txt", "read", "user", None),
        ("/home/user/a b/ü.txt", "write", None, None),  # no username: signed as ""
        ("x", "read", "root", 120),
    ],
)
def test_the_sdks_signature_names_its_sandbox(
    path: str, op: str, user: str | None, expires_in: int | None
) -> None:
    q = _query(path, op, user, "tok-c", expires_in)
    assert signed.signer(q, op, SANDBOXES, labels.E2B_TOKEN).id == "c"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"path": "other.txt"}, signed.INVALID),  # another file
        ({"username": "root"}, signed.INVALID),  # another user
        ({"signature": "v1_forged"}, signed.INVALID),
        ({"signature_expiration": str(int(time.time()) + 10**6)}, signed.INVALID),  # stretched
    ],
)
def test_a_signature_answers_for_what_it_signed_alone(change: dict[str, str], message: str) -> None:
    q = dict(_query("notes.txt", "read", "user", "tok-b", 60))
    with pytest.raises(ConnectError) as err:
        signed.signer(QueryParams({**q, **change}), "read", SANDBOXES, labels.E2B_TOKEN)
    assert (err.value.code, err.value.message) == ("unauthenticated", message)


def test_a_read_signature_does_not_write_and_none_opens_a_missing_sandbox() -> None:
    q = _query("notes.txt", "read", "user", "tok-b", None)
    for op, found in (("write", SANDBOXES), ("read", [SANDBOXES[2]])):
        with pytest.raises(ConnectError, match=signed.INVALID):
            signed.signer(q, op, found, labels.E2B_TOKEN)


def test_an_expired_signature_says_so_once_it_matched() -> None:
    q = _query("notes.txt", "read", "user", "tok-b", -120)
    with pytest.raises(ConnectError) as err:
        signed.signer(q, "read", SANDBOXES, labels.E2B_TOKEN)
    assert (err.value.code, err.value.message) == ("unauthenticated", signed.EXPIRED)
    with pytest.raises(ConnectError) as err:  # not an oracle: no match, no word of time
        signed.signer(q, "read", SANDBOXES[:1], labels.E2B_TOKEN)
    assert err.value.message == signed.INVALID


@pytest.mark.parametrize(
    "change",
    [
        {"signature": "v1_short"},
        {"signature": "v2_" + "A" * 43},
        {"signature_expiration": "--5"},
        {"signature_expiration": "²"},
        {"signature_expiration": "9" * 5000},  # int() of it raises past 4,300 digits
        {"username": "us:er"},  # ':' would make two (path, user) pairs sign alike
    ],
)
def test_a_query_no_sdk_signed_is_refused_before_any_lookup(change: dict[str, str]) -> None:
    q = QueryParams({**dict(_query("notes.txt", "read", "user", "tok-b", 60)), **change})
    with pytest.raises(ConnectError) as err:
        signed.check_form(q)
    assert (err.value.code, err.value.message) == ("unauthenticated", signed.INVALID)


class _Node:
    """A node's service: its E2B sandboxes, and how often they were listed."""

    def __init__(self) -> None:
        self.sandboxes: list[Any] = []
        self.listings = 0

    async def list(self) -> list[Any]:
        self.listings += 1
        await asyncio.sleep(0.01)
        return list(self.sandboxes)


def _info(sandbox_id: str, token: str) -> Any:
    return SimpleNamespace(
        id=sandbox_id, labels={labels.E2B_TOKEN: token}, state=SimpleNamespace(value="running")
    )


async def test_a_sandbox_made_a_moment_ago_is_found_and_misses_share_one_listing() -> None:
    node = _Node()
    e = envd.Envd(_no_gateway, local=node)  # type: ignore[arg-type]
    node.sandboxes.append(_info("a", "tok-a"))
    q = _query("f", "read", "user", "tok-a", None)
    assert (await e._signer(node, q, "read")).id == "a"  # type: ignore[arg-type]
    node.sandboxes.append(_info("b", "tok-b"))  # made since the list
    q = _query("f", "read", "user", "tok-b", None)
    assert (await e._signer(node, q, "read")).id == "b"  # type: ignore[arg-type]
    before = node.listings
    forged = _query("f", "read", "user", "nobody's", None)
    results = await asyncio.gather(
        *(e._signer(node, forged, "read") for _ in range(20)),  # type: ignore[arg-type]
        return_exceptions=True,
    )
    assert all(isinstance(r, ConnectError) and r.message == signed.INVALID for r in results)
    # Twenty misses: the first one's listing, and one begun after the others
    # arrived (a sandbox made meanwhile would be on it), which they share.
    assert node.listings - before == 2


async def _no_gateway(sandbox_id: str) -> Any:
    raise AssertionError("a node's signed URL asks no gateway")
