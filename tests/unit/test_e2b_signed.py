"""E2B's signed file URLs (api/compat/e2b/signed.py): the signature the
stock SDK makes is the one Corral checks, and a signature answers for
its own path, operation, user, sandbox and time alone."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.datastructures import QueryParams

from corral import labels
from corral.api.compat.e2b import signed
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
