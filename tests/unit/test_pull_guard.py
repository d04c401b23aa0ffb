"""The egress guard of a tenant's registry pull (images/egress.py): a real
CONNECT proxy on loopback, a resolver that says what a hostile DNS would."""

from __future__ import annotations

import base64
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from corral.config import NodeConfig
from corral.errors import InvalidArgument
from corral.images.egress import PROXY_PORT, PullGuard, Unresolved

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
    "nat64.example": ["64:ff9b::a9fe:a9fe"],  # the metadata service through NAT64
}


def fake_dns(host: str, port: int) -> list[str]:
    return ANSWERS.get(host, [])


@pytest.mark.parametrize(
    ("host", "port", "why"),
    [
        ("evil.example", 443, "resolves to an address inside"),
        ("meta.example", 443, "resolves to an address inside"),
        ("split.example", 443, "resolves to an address inside"),
        ("mapped.example", 443, "resolves to an address inside"),
        ("shared.example", 443, "resolves to an address inside"),
        ("ctl.example", 443, "resolves to an address inside"),
        ("nat64.example", 443, "resolves to an address inside"),
        ("127.1", 443, "names an address inside"),
        ("LOCALHOST.", 443, "names an address inside"),
        ("registry.internal", 443, "names an address inside"),
        ("10.1.2.3", 443, "names an address inside"),
        ("mirror.corp", 5001, "resolves to an address inside"),  # listed with another port
    ],
)
def test_an_inside_address_is_refused_however_it_is_named(
    monkeypatch: pytest.MonkeyPatch, host: str, port: int, why: str
) -> None:
    monkeypatch.setenv("CORRAL_REGISTRIES", "mirror.corp:5000")
    guard = PullGuard(deny=["93.184.216.40/32"], resolve=fake_dns)
    with pytest.raises(PermissionError, match=why):
        guard.check(host, port)


def test_a_name_with_no_address_is_unresolved_not_refused() -> None:
    """The registry is unreachable, as it would be unguarded: Unavailable
    for the pull, not a rule the tenant broke."""
    with pytest.raises(Unresolved, match="resolves to no address"):
        PullGuard(resolve=fake_dns).check("nowhere.example", 443)


def test_public_and_listed_registries_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_REGISTRIES", "mirror.corp:5000")
    guard = PullGuard(resolve=fake_dns)
    assert guard.check("public.example", 443) == ["93.184.216.34"]
    assert guard.check("mirror.corp", 5000) == ["127.0.0.1"]


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

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    server.shutdown(socket.SHUT_RDWR)  # wakes its accept()
    server.close()
    thread.join(5)


def _serving(guard: PullGuard) -> int:
    """The guard answering on a loopback port (a guarded pull's listener is
    in the pull's own network namespace: tests/integration/test_registry.py)."""
    listener = socket.create_server(("127.0.0.1", 0))
    guard.serve(listener)
    return int(listener.getsockname()[1])


def _connect(
    port: int, guard: PullGuard, target: str, auth: bool = True
) -> tuple[socket.socket, bytes]:
    creds = guard.env["HTTPS_PROXY"].removeprefix("http://").partition("@")[0]
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
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
    monkeypatch.setenv("CORRAL_REGISTRIES", f"Mirror.Corp:{echo}")  # read as a resolver reads it
    with PullGuard(resolve=fake_dns) as guard:
        port = _serving(guard)
        sock, status = _connect(port, guard, f"mirror.corp:{echo}")
        with sock:
            assert status == b"HTTP/1.1 200 Connection established"
            sock.sendall(b"hello through the tunnel")
            assert sock.recv(100) == b"hello through the tunnel"
        sock, status = _connect(port, guard, f"evil.example:{echo}")
        sock.close()
        assert status == b"HTTP/1.1 403 Forbidden"
        # What a tenant is told names no address (its DNS may be the node's).
        assert guard.refused == ["evil.example resolves to an address inside the cluster's network"]
        sock, status = _connect(port, guard, f"mirror.corp:{echo}", auth=False)
        sock.close()
        assert status == b"HTTP/1.1 407 Proxy Authentication Required"
        assert guard.env["HTTPS_PROXY"].endswith(f"@127.0.0.1:{PROXY_PORT}")


def test_plain_http_and_bad_heads_are_never_forwarded(echo: int) -> None:
    with PullGuard(resolve=fake_dns) as guard:
        port = _serving(guard)
        for head in (f"GET http://127.0.0.1:{echo}/ HTTP/1.1\r\nHost: x\r\n\r\n",
                     f"CONNECT mirror.corp:{echo}@evil HTTP/1.1\r\n\r\n",
                     "CONNECT \u00e9:443 HTTP/1.1\r\nProxy-Authorization: \u00e9\r\n\r\n",
                     "CONNECT public.example:443 HTTP/1.1\r\n\r\nearly bytes"):  # fmt: skip
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(head.encode())
                answer = b""
                while more := sock.recv(1024):
                    answer += more
            assert not answer.startswith(b"HTTP/1.1 200"), (head, answer)


@pytest.mark.parametrize("bad", ["example.com", "10.0.0.0/33", "", "1.2.3.4/8/9"])
def test_a_network_deny_entry_must_be_a_network(bad: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        NodeConfig(network_deny=["10.0.0.0/8", bad])
    assert exc.value.field == "network_deny[1]" and exc.value.value == bad


@contextmanager
def _tunnel_to(
    monkeypatch: pytest.MonkeyPatch, serve: Callable[[socket.socket], None]
) -> Iterator[socket.socket]:
    """A tunnel, through a guard, to a one-connection server (a listed
    registry) that runs `serve` on its connection."""
    server = socket.create_server(("127.0.0.1", 0))

    def one() -> None:
        conn, _ = server.accept()
        with conn:
            serve(conn)

    thread = threading.Thread(target=one, daemon=True)
    thread.start()
    target = f"mirror.corp:{server.getsockname()[1]}"
    monkeypatch.setenv("CORRAL_REGISTRIES", target)
    try:
        with PullGuard(resolve=fake_dns) as guard:
            sock, status = _connect(_serving(guard), guard, target)
            with sock:
                assert status == b"HTTP/1.1 200 Connection established"
                yield sock
    finally:
        thread.join(5)
        server.close()


def test_a_tunnel_carries_large_transfers_both_ways_and_passes_half_closes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tunnel moves bytes by splice(2) through a pipe per direction:
    more than a pipe holds, each way, and a client's end of request (a
    half close) reaches the registry, whose answer still comes back whole."""
    size = 8 << 20

    def serve(conn: socket.socket) -> None:
        got = 0
        while data := conn.recv(1 << 16):  # all of it, to the client's half close
            got += len(data)
        conn.sendall(b"x" * got)

    with _tunnel_to(monkeypatch, serve) as sock:
        sock.sendall(b"y" * size)
        sock.shutdown(socket.SHUT_WR)
        got = 0
        while data := sock.recv(1 << 20):
            got += len(data)
        assert got == size


@pytest.mark.parametrize("closes", [True, False])
def test_urgent_data_neither_spins_the_tunnel_nor_stops_its_bytes(
    monkeypatch: pytest.MonkeyPatch, closes: bool
) -> None:
    """splice(2) stops short of TCP urgent data: while the socket stays
    readable (EAGAIN, before, spun the tunnel's loop and the bytes after
    it never came), and once the peer has closed (0, before, ended the
    tunnel early)."""
    done = threading.Event()

    def serve(conn: socket.socket) -> None:
        conn.recv(1)
        conn.send(b"!", socket.MSG_OOB)
        conn.sendall(b"after the urgent byte")
        if not closes:
            done.wait(10)

    with _tunnel_to(monkeypatch, serve) as sock:
        sock.sendall(b"g")  # one byte: the server reads it all (unread bytes: a reset)
        got = b""
        while not got.endswith(b"after the urgent byte") and (data := sock.recv(1024)):
            got += data
        assert got == b"after the urgent byte"
        done.set()
