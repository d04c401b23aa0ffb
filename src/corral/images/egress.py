"""Where a node may pull from for a tenant: never inside the cluster's network.

A create through a gateway may name any registry, and the node pulls it as
root, from inside the cluster's network. A check of the name alone
(`inside_name`, the gateway's first line) cannot see where a public name
resolves: `evil.example` may answer 10.0.0.5 or 169.254.169.254, and
answer differently a second later. So a guarded pull (NodeConfig.pull_guard,
on for cluster nodes) gives skopeo one way out: this HTTP CONNECT proxy,
which resolves every name itself, refuses when any address it gets is
inside (loopback, private, link-local, shared, or a network the node is
told to deny), and connects to an address it checked. Redirects (a
registry's blobs on a CDN, its token server) pass through it too.

CORRAL_REGISTRIES (HOST[:PORT], comma-separated; the gateway reads it to
limit which registries a create may name) also names the registries the
guard lets through wherever they resolve: an operator's own registry on a
private address.

The proxy listens on the node's loopback, one per pull, with a random
credential; a sandbox cannot reach the node's loopback (its own network
namespace) and could not use the proxy without the credential if it did.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import re
import secrets
import selectors
import socket
import socketserver
import threading
from collections.abc import Callable, Iterable
from types import TracebackType

from corral.log import get_logger

log = get_logger("corral.images")

# Every label a number (decimal, octal, 0x hex): an address in disguise.
_NUMERIC = re.compile(r"(?:(?:0x[0-9a-f]*|[0-9]+)\.){0,3}(?:0x[0-9a-f]*|[0-9]+)")
_LOCAL_NAMES = (".localhost", ".local", ".internal", ".lan", ".home.arpa", ".cluster.local")
HEAD_MAX = 8192  # a CONNECT request's head
CONNECT_TIMEOUT = 15.0
IDLE_TIMEOUT = 300.0  # a tunnel with no byte either way for this long is closed

Resolver = Callable[[str, int], list[str]]
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def allowed_registries() -> list[str]:
    """CORRAL_REGISTRIES: the registries a cluster pulls from, if listed."""
    return [h.strip() for h in os.environ.get("CORRAL_REGISTRIES", "").split(",") if h.strip()]


def host_name(host: str) -> str:
    """A registry host as a resolver reads it: no port, no brackets, lower
    case, no trailing dot (LOCALHOST. is localhost)."""
    name = host[1:].split("]")[0] if host.startswith("[") else host.partition(":")[0]
    return name.lower().rstrip(".")


def host_port(host: str) -> tuple[str, int]:
    """A registry's HOST[:PORT] as (name, port): HTTPS's 443 where none."""
    name = host_name(host)
    tail = host.rsplit("]", 1)[-1] if host.startswith("[") else host
    _, colon, port = tail.rpartition(":")
    return name, int(port) if colon and port.isdigit() else 443


def inside_name(host: str) -> bool:
    """A registry host (HOST[:PORT]) that names the cluster's own network by
    itself: a non-public address, a number the C resolver reads as one
    (127.1, 2130706433, 0x7f.1), localhost or a local suffix."""
    return _inside(host_name(host))


def _inside(name: str) -> bool:
    try:
        return not ipaddress.ip_address(name).is_global
    except ValueError:
        return bool(_NUMERIC.fullmatch(name)) or name == "localhost" or name.endswith(_LOCAL_NAMES)


def _resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class PullGuard:
    """One pull's proxy (a context manager): `env` points skopeo at it;
    `refused` says what it refused, for the pull's error."""

    def __init__(self, deny: Iterable[str] = (), resolve: Resolver = _resolve) -> None:
        self.deny: list[Network] = [ipaddress.ip_network(n, strict=False) for n in deny]
        self.allowed = set(allowed_registries())
        self.resolve = resolve
        self.refused: list[str] = []
        self._token = secrets.token_urlsafe(24)
        self._server: socketserver.ThreadingTCPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------ policy

    def _outside(self, ip: Address) -> bool:
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return ip.is_global and not any(ip in net for net in self.deny)

    def check(self, host: str, port: int) -> list[str]:
        """The addresses `host`:`port` may be reached at; PermissionError
        (with the reason) where any address it has is inside."""
        listed = f"{host}:{port}" in self.allowed or (port == 443 and host in self.allowed)
        if not listed and _inside(host.lower().rstrip(".")):
            raise PermissionError(f"{host} names an address inside the cluster's network")
        addresses = self.resolve(host, port)
        if not addresses:
            raise PermissionError(f"{host} resolves to no address")
        if not listed:
            for text in addresses:
                if not self._outside(ipaddress.ip_address(text.split("%")[0])):
                    raise PermissionError(
                        f"{host} resolves to {text}, inside the cluster's network"
                    )
        return addresses

    # ------------------------------------------------------------- proxy

    @property
    def url(self) -> str:
        assert self._server is not None, "PullGuard is used as a context manager"
        port = self._server.server_address[1]
        return f"http://corral:{self._token}@127.0.0.1:{port}"

    @property
    def env(self) -> dict[str, str]:
        """skopeo's environment additions: every request through the proxy
        (Go's net/http reads both spellings; NO_PROXY must exempt nothing)."""
        url = self.url
        return {"HTTPS_PROXY": url, "https_proxy": url, "HTTP_PROXY": url, "http_proxy": url,
                "NO_PROXY": "", "no_proxy": ""}  # fmt: skip

    def __enter__(self) -> PullGuard:
        guard = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                guard._serve(self.request)

        server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler, bind_and_activate=True)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="pull-guard", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def _serve(self, client: socket.socket) -> None:
        client.settimeout(CONNECT_TIMEOUT)
        try:
            self._tunnel(client)
        except (OSError, ValueError):
            pass  # a client gone, or not a CONNECT: nothing is forwarded
        finally:
            client.close()

    def _tunnel(self, client: socket.socket) -> None:
        target = self._target(_read_head(client))
        if target is None:
            _answer(client, 407, "Proxy Authentication Required")
            return
        host, port = target
        try:
            addresses = self.check(host, port)
        except PermissionError as exc:
            self.refused.append(str(exc))
            log.warning("image.pull_refused", host=host, port=port, reason=str(exc))
            _answer(client, 403, "Forbidden")
            return
        upstream = _connect(addresses, port)
        if upstream is None:
            _answer(client, 502, "Bad Gateway")
            return
        with upstream:
            client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            _splice(client, upstream)

    def _target(self, head: bytes) -> tuple[str, int] | None:
        """(host, port) of an authenticated CONNECT; None: not authenticated.
        ValueError: not a CONNECT (plain HTTP is never forwarded)."""
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        if method != "CONNECT":
            raise ValueError("only CONNECT")
        want = "Basic " + base64.b64encode(f"corral:{self._token}".encode()).decode()
        given = [v.strip() for k, _, v in (x.partition(":") for x in lines[1:])
                 if k.strip().lower() == "proxy-authorization"]  # fmt: skip
        if not given or not secrets.compare_digest(given[0], want):
            return None
        host, _, port = target.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        number = int(port)
        if not host or not 0 < number < 65536:
            raise ValueError("bad target")
        return host, number


def _read_head(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(HEAD_MAX - len(data))
        if not more or len(data) + len(more) >= HEAD_MAX:
            raise ValueError("no request head")
        data += more
    head, _, rest = data.partition(b"\r\n\r\n")
    if rest:  # a client speaks only after the tunnel is up
        raise ValueError("bytes before the tunnel")
    return head


def _answer(sock: socket.socket, code: int, reason: str) -> None:
    extra = 'Proxy-Authenticate: Basic realm="corral"\r\n' if code == 407 else ""
    sock.sendall(f"HTTP/1.1 {code} {reason}\r\n{extra}Content-Length: 0\r\n\r\n".encode())


def _connect(addresses: list[str], port: int) -> socket.socket | None:
    for address in addresses:
        try:
            return socket.create_connection((address, port), timeout=CONNECT_TIMEOUT)
        except OSError:
            continue
    return None


def _splice(a: socket.socket, b: socket.socket) -> None:
    """Bytes both ways until both sides have ended (or one is idle past
    IDLE_TIMEOUT); an end on one side is passed on as a half close."""
    a.setblocking(False)
    b.setblocking(False)
    peer = {a: b, b: a}
    open_ = {a, b}
    with selectors.DefaultSelector() as sel:
        for s in open_:
            sel.register(s, selectors.EVENT_READ)
        while open_:
            ready = sel.select(IDLE_TIMEOUT)
            if not ready:
                return
            for key, _ in ready:
                src = key.fileobj
                assert isinstance(src, socket.socket)
                try:
                    data = src.recv(1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(src)
                    open_.discard(src)
                    try:
                        peer[src].shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    continue
                peer[src].settimeout(IDLE_TIMEOUT)  # a peer that stops reading is dropped
                peer[src].sendall(data)
                peer[src].setblocking(False)
