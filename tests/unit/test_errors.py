from __future__ import annotations

import pytest

import corral
from corral.errors import ERROR_CODES, CorralError, InvalidArgument, NodeFull, error_from_wire


@pytest.mark.parametrize("code", sorted(ERROR_CODES))
def test_every_code_round_trips_through_the_wire(code: str) -> None:
    cls = ERROR_CODES[code]
    if cls is InvalidArgument:
        err: CorralError = InvalidArgument("memory", "must be a size", "lots")
    elif cls is NodeFull:
        err = NodeFull("node n1 is full", node="n1", reason="slots")
    else:
        err = cls("something broke", sandbox="local-1")
    back = error_from_wire(err.to_wire(), err.http_status)
    assert type(back) is cls
    assert back.message == err.message
    assert back.code == code
    if cls is NodeFull:  # the gateway reads why and where from the details
        assert back.details == {"node": "n1", "reason": "slots"}
    assert isinstance(back, corral.CorralError)


def test_invalid_argument_names_field_rule_and_value() -> None:
    err = InvalidArgument("memory", "must be a size like '512MiB'", "lots")
    assert str(err) == "memory: must be a size like '512MiB' (got 'lots')"
    wire = err.to_wire()
    assert wire["field"] == "memory" and wire["value"] == "'lots'" and "size" in wire["rule"]


def test_builtin_bases_let_callers_catch_what_they_know() -> None:
    assert issubclass(corral.CommandTimeout, TimeoutError)
    assert issubclass(corral.FileNotFound, FileNotFoundError)
    assert issubclass(corral.SandboxNotFound, corral.NotFound)


def test_unknown_code_from_a_peer_is_an_internal_error_not_an_import() -> None:
    err = error_from_wire({"code": "os.system", "message": "x"}, 500)
    assert type(err) is corral.InternalError


def test_huge_values_are_shown_short() -> None:
    err = InvalidArgument("data", "too big", b"x" * 10_000)
    assert "<10000 bytes>" in str(err)
