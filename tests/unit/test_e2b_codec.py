"""The pure parts of the E2B adapter (api/compat/e2b): the Connect codec,
template specs, page tokens, the routing of a sandbox's ports, and the
errors each bad value gets."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
from starlette.requests import Request

from corral.api.compat.e2b import connect, control, ports
from corral.api.compat.e2b.process import _pty_size, decode_input, signal_of
from corral.errors import (
    CommandNotFound,
    FileError,
    FileNotFound,
    InvalidArgument,
    SandboxClosed,
    Unauthenticated,
)


def _request(body: bytes, headers: dict[str, str]) -> Request:
    scope = {
        "type": "http", "method": "POST", "path": "/x", "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
    }  # fmt: skip
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return Request(scope, receive)


def _env(doc: object, flags: int = 0, length: int | None = None) -> bytes:
    data = json.dumps(doc).encode()
    return struct.pack(">BI", flags, len(data) if length is None else length) + data


async def test_a_request_message_is_read_from_json_or_one_envelope() -> None:
    assert await connect.read_request(
        _request(b'{"a": 1}', {"content-type": "application/json"})
    ) == {"a": 1}
    stream = _request(_env({"b": 2}), {"content-type": connect.STREAM_TYPE})
    assert await connect.read_request(stream) == {"b": 2}
    assert await connect.read_request(_request(b"", {"content-type": "application/json"})) == {}


@pytest.mark.parametrize(("body", "ctype", "code"), [
    (b"{not json", "application/json", "invalid_argument"),
    (b"[1, 2]", "application/json", "invalid_argument"),  # not an object
    (b'{"a":1}', "application/proto", "unimplemented"),  # Connect JSON only
    (b"\x00\x00", connect.STREAM_TYPE, "invalid_argument"),  # shorter than a header
    (_env({"a": 1}, length=99), connect.STREAM_TYPE, "invalid_argument"),  # length lies
    (_env({"a": 1}, flags=1), connect.STREAM_TYPE, "unimplemented"),  # compressed
])  # fmt: skip
async def test_a_bad_request_message_gets_its_connect_code(
    body: bytes, ctype: str, code: str
) -> None:
    with pytest.raises(connect.ConnectError) as e:
        await connect.read_request(_request(body, {"content-type": ctype}))
    assert e.value.code == code


@pytest.mark.parametrize(("exc", "code"), [
    (FileNotFound("gone", path="/x"), "not_found"),
    (CommandNotFound("no pid"), "not_found"),
    (InvalidArgument("path", "must be absolute", "x"), "invalid_argument"),
    (Unauthenticated("no"), "unauthenticated"),
    (SandboxClosed("closed"), "unavailable"),
    (FileError("exists", errno=17, strerror="EEXIST"), "already_exists"),
    (FileError("denied", errno=13, strerror="EACCES"), "permission_denied"),
    (RuntimeError("boom"), "internal"),
])  # fmt: skip
def test_corral_errors_map_to_connect_codes(exc: Exception, code: str) -> None:
    err = connect.from_corral(exc)
    assert err.code == code
    assert connect.HTTP_STATUS[err.code] >= 400


def test_a_stream_ends_with_an_end_envelope() -> None:
    end = connect.end_stream(connect.ConnectError("not_found", "nope"))
    flags, n = struct.unpack(">BI", end[:5])
    assert (
        flags == connect.END_STREAM and json.loads(end[5 : 5 + n])["error"]["code"] == "not_found"
    )
    assert json.loads(connect.end_stream()[5:]) == {}


@pytest.mark.parametrize(("spec", "want", "start"), [
    ("img:1", {"image": "img:1"}, None),
    ("img:1 workspace=ws:2 toolkit=a:1,b:2 memory=512MiB cpu=0.5 start=/opt/start",
     {"image": "img:1", "workspace": "ws:2", "toolkit": ["a:1", "b:2"], "memory": "512MiB",
      "cpu": "0.5"}, "/opt/start"),
    ("img:1 kind=microvm", {"image": "img:1", "kind": "microvm"}, None),
])  # fmt: skip
def test_template_specs(spec: str, want: dict[str, Any], start: str | None) -> None:
    assert control.template_spec({"t": spec}, "t") == (want, start)
    assert control.template_spec({}, "debian-python:bookworm") == (
        {"image": "debian-python:bookworm"},
        None,
    )


@pytest.mark.parametrize("spec", ["img:1 gpu=1", "img:1 start=relative/path", "img:1 toolkit"])
def test_a_template_spec_with_an_unknown_part_names_it(spec: str) -> None:
    with pytest.raises(control.E2bError) as e:
        control.template_spec({"t": spec}, "t")
    assert spec.split()[1] in e.value.message


def test_the_default_templates_parse() -> None:
    from corral.config import DEFAULT_E2B_TEMPLATES

    for name in DEFAULT_E2B_TEMPLATES:
        control.template_spec(DEFAULT_E2B_TEMPLATES, name)


@pytest.mark.parametrize("token", ["garbage", "e30=", "WzEsIDJd"])  # not base64 JSON, not a pair
def test_a_page_token_this_server_did_not_give_is_refused(token: str) -> None:
    with pytest.raises(control.E2bError) as e:
        control._cursor(token)
    assert e.value.status == 400


@pytest.mark.parametrize(("doc", "ok"), [
    ({}, True), ({"timeout": 300}, True), ({"timeout": 0}, False), ({"timeout": -1}, False),
    ({"timeout": "300"}, False), ({"timeout": True}, False), ({"timeout": 31 * 86400}, False),
])  # fmt: skip
def test_timeouts(doc: dict[str, Any], ok: bool) -> None:
    if ok:
        assert control._timeout(doc) in (300,)
    else:
        with pytest.raises(control.E2bError):
            control._timeout(doc)


@pytest.mark.parametrize(("headers", "want"), [
    ({"e2b-sandbox-id": "t-0123456789abcdef", "e2b-sandbox-port": "8000"}, ("t-0123456789abcdef", 8000)),
    ({"e2b-sandbox-id": "t-0123456789abcdef", "e2b-sandbox-port": "49983"}, None),  # envd itself
    ({"host": "8000-t-0123456789abcdef.corral.local"}, ("t-0123456789abcdef", 8000)),
    ({"host": "49983-t-0123456789abcdef.corral.local"}, None),
    ({"host": "127.0.0.1:7070"}, None),
    ({"e2b-sandbox-id": "t-0123456789abcdef", "e2b-sandbox-port": "99999"}, ("t-0123456789abcdef", 0)),
    ({"e2b-sandbox-id": "t-0123456789abcdef", "e2b-sandbox-port": "x"}, ("t-0123456789abcdef", 0)),
])  # fmt: skip
def test_a_sandboxs_port_is_found_by_header_or_host(
    headers: dict[str, str], want: tuple[str, int] | None
) -> None:
    assert ports.target(_request(b"", headers)) == want


def test_process_inputs() -> None:
    assert decode_input({"input": {"stdin": "aGk="}}) == b"hi"
    assert decode_input({"input": {"pty": "aGk="}}) == b"hi"
    with pytest.raises(connect.ConnectError):
        decode_input({"input": {"stdin": "not base64!"}})
    assert signal_of("SIGNAL_SIGKILL") == 9 and signal_of("SIGNAL_SIGTERM") == 15
    with pytest.raises(connect.ConnectError):
        signal_of("SIGNAL_SIGSTOP")
    assert _pty_size({"size": {"rows": 40, "cols": 120}}) == (40, 120)
    assert _pty_size(None) is None
    for bad in (
        {"size": {"rows": 0, "cols": 80}},
        {"size": {"rows": "x"}},
        {"size": {"cols": 5000}},
    ):
        with pytest.raises(connect.ConnectError):
            _pty_size(bad)


def test_allow_out_becomes_corrals_policy_on_any_port() -> None:
    policy = control.network_of(
        {"network": {"allowOut": ["10.1.2.3", "192.168.0.0/16", "pypi.org", "*.example.com"],
                     "denyOut": ["0.0.0.0/0"], "allowPublicTraffic": False}}
    )  # fmt: skip
    assert policy is not None
    assert policy.cidrs == ["10.1.2.3/32", "192.168.0.0/16"]
    assert policy.domains == ["pypi.org", "*.example.com"] and policy.ports == []
    # Nothing named: no network, whatever allow_internet_access says.
    assert control.network_of({"allow_internet_access": True}) is None
    assert control.network_of({"network": {"denyOut": ["8.8.8.8"]}}) is None


@pytest.mark.parametrize(("network", "field"), [
    ("everything", "network"),
    ({"allowOut": "pypi.org"}, "allowOut"),
    ({"allowOut": [1]}, "allowOut"),
    ({"denyOut": {"a": 1}}, "denyOut"),
    ({"allowOut": ["not a host!"]}, "allowOut"),
    ({"rules": {"api.example.com": {}}}, "rules"),
    ({"egressProxy": {"address": "socks5://x"}}, "egressProxy"),
    ({"maskRequestHost": "x.example"}, "maskRequestHost"),
])  # fmt: skip
def test_bad_network_fields_are_named(network: Any, field: str) -> None:
    with pytest.raises(control.E2bError) as e:
        control.network_of({"network": network})
    assert e.value.status == 400 and field in e.value.message


async def test_a_request_message_past_its_cap_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connect, "MAX_MESSAGE", 100)
    body = json.dumps({"a": "x" * 200}).encode()
    with pytest.raises(connect.ConnectError) as e:
        await connect.read_request(_request(body, {"content-type": "application/json"}))
    assert e.value.code == "resource_exhausted"


@pytest.mark.parametrize(("host", "want"), [
    ("49983-t-0123456789abcdef.corral.local", "t-0123456789abcdef"),  # envd by host
    ("8000-t-0123456789abcdef.corral.local", ""),  # a port of it, not envd
    ("127.0.0.1:7070", ""),
    ("49983-T-0123456789ABCDEF.corral.local", ""),  # ids are lower case
])  # fmt: skip
def test_envd_is_found_by_host_too(host: str, want: str) -> None:
    assert ports.envd_sandbox(host) == want


@pytest.mark.parametrize(("doc", "want"), [
    ({}, "close"),
    ({"autoPause": False, "autoPauseMemory": False}, "close"),
    ({"autoPause": True}, "suspend"),
    ({"autoPause": True, "autoPauseMemory": True}, "suspend"),
    ({"autoPause": True, "autoPauseMemory": False}, "disk"),  # filesystem-only: memory given back
    ({"autoPause": True, "autoResume": {"enabled": False}}, "suspend"),
    ({"autoPause": "yes"}, None),
    ({"autoPause": True, "autoPauseMemory": 0}, None),
])  # fmt: skip
def test_e2b_lifecycle_is_corrals_on_expiry(doc: dict[str, object], want: str | None) -> None:
    if want is None:
        with pytest.raises(control.E2bError):
            control._on_timeout(doc)
    else:
        assert control._on_timeout(doc) == want
