"""The egress guard of a tenant's registry pull (images/egress.py): a real
CONNECT proxy on loopback, a resolver that says what a hostile DNS would."""

from __future__ import annotations

import base64
import socket
import threading
from collections.abc import Iterator

import pytest

from corral.config import NodeConfig
from corral.errors import InvalidArgument
from corral.images.egress import PullGuard, host_port, inside_name

pytestmark = pytest.mark.unit

ANSWERS = {
    "evil.example": ["10.0.0.5"],
    "meta.example": ["169.254.169.254"],
    "split.example": ["93.184.216.34", "127.0.0.1"],  # one public, one not: refused
    "mapped.example": ["::ffff:127.0.0.1"],
    "shared.example": ["100.64.0.1"],  # carrier-grade NAT space is not public
    "ctl.example": ["93.184.216.40"],  # public, but the cluster's own (denied)
    "public.example": ["93.184.216.34"],
    "mirror.corp": ["127.0.0.1"],  # the operator's, listed in CORRAL_REGISTRIES
}


def fake_dns(host: str, port: int) -> list[str]:
    return ANSWERS.get(host, [])


@pytest.mark.parametrize(
    ("host", "port", "why"),
    [
        ("evil.example", 443, "resolves to 10.0.0.5"),
        ("meta.example", 443, "resolves to 169.254.169.254"),
        ("split.example", 443, "resolves to 127.0.0.1"),
        ("mapped.example", 443, "resolves to ::ffff:127.0.0.1"),
        ("shared.example", 443, "resolves to 100.64.0.1"),
        ("ctl.example", 443, "resolves to 93.184.216.40"),
        ("nowhere.example", 443, "resolves to no address"),
        ("127.1", 443, "names an address inside"),
        ("LOCALHOST.", 443, "names an address inside"),
        ("registry.internal", 443, "names an address inside"),
        ("10.1.2.3", 443, "names an address inside"),
        ("mirror.corp", 5001, "resolves to 127.0.0.1"),  # listed with another port
    ],
)
def test_an_inside_address_is_refused_however_it_is_named(
    monkeypatch: pytest.MonkeyPatch, host: str, port: int, why: str
) -> None:
    monkeypatch.setenv("CORRAL_REGISTRIES", "mirror.corp:5000")
    guard = PullGuard(deny=["93.184.216.40/32"], resolve=fake_dns)
    with pytest.raises(PermissionError, match=why):
        guard.check(host, port)


def test_public_and_listed_registries_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_REGISTRIES", "mirror.corp:5000")
    guard = PullGuard(resolve=fake_dns)
    assert guard.check("public.example", 443) == ["93.184.216.34"]
    assert guard.check("mirror.corp", 5000) == ["127.0.0.1"]


@pytest.mark.parametrize(
    ("host", "split", "inside"),
    [("ghcr.io", ("ghcr.io", 443), False), ("reg.example:5000", ("reg.example", 5000), False),
     ("[::1]:5000", ("::1", 5000), True), ("0x7f.1", ("0x7f.1", 443), True),
     ("2130706433", ("2130706433", 443), True), ("a.cluster.local", ("a.cluster.local", 443), True)],
)  # fmt: skip
def test_registry_hosts_as_a_resolver_reads_them(
    host: str, split: tuple[str, int], inside: bool
) -> None:
    assert host_port(host) == split and inside_name(host) is inside


@pytest.fixture
def echo() -> Iterator[int]:
    """A TCP server on loopback that answers every byte back."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                while data := conn.recv(4096):
                    conn.sendall(data)

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


def _connect(guard: PullGuard, target: str, auth: bool = True) -> tuple[socket.socket, bytes]:
    url = guard.url.removeprefix("http://")
    creds, _, where = url.partition("@")
    host, _, port = where.partition(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    head = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
    if auth:
        head += f"Proxy-Authorization: Basic {base64.b64encode(creds.encode()).decode()}\r\n"
    sock.sendall((head + "\r\n").encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        more = sock.recv(1024)
        if not more:
            break
        answer += more
    return sock, answer.split(b"\r\n", 1)[0]


def test_the_proxy_tunnels_to_a_listed_registry_and_refuses_the_rest(
    monkeypatch: pytest.MonkeyPatch, echo: int
) -> None:
    monkeypatch.setenv("CORRAL_REGISTRIES", f"mirror.corp:{echo}")
    with PullGuard(resolve=fake_dns) as guard:
        sock, status = _connect(guard, f"mirror.corp:{echo}")
        with sock:
            assert status == b"HTTP/1.1 200 Connection established"
            sock.sendall(b"hello through the tunnel")
            assert sock.recv(100) == b"hello through the tunnel"
        sock, status = _connect(guard, f"evil.example:{echo}")
        sock.close()
        assert status == b"HTTP/1.1 403 Forbidden"
        assert guard.refused == ["evil.example resolves to 10.0.0.5, inside the cluster's network"]
        sock, status = _connect(guard, f"mirror.corp:{echo}", auth=False)
        sock.close()
        assert status == b"HTTP/1.1 407 Proxy Authentication Required"
        assert set(guard.env.values()) - {""} == {guard.url}


def test_plain_http_is_never_forwarded(echo: int) -> None:
    with PullGuard(resolve=fake_dns) as guard:
        url = guard.url.removeprefix("http://").partition("@")[2]
        host, _, port = url.partition(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(f"GET http://127.0.0.1:{echo}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            assert sock.recv(100) == b""  # closed, nothing sent on


@pytest.mark.parametrize("bad", ["example.com", "10.0.0.0/33", "", "1.2.3.4/8/9"])
def test_a_network_deny_entry_must_be_a_network(bad: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        NodeConfig(network_deny=["10.0.0.0/8", bad])
    assert exc.value.field == "network_deny[1]" and exc.value.value == bad
