"""Where a node may pull from for a tenant: never inside the cluster's network.

A create through a gateway may name any registry, and the node pulls it as
root, from inside the cluster's network. A check of the name alone
(`inside_name`, the gateway's first line) cannot see where a public name
resolves: `evil.example` may answer 10.0.0.5 or 169.254.169.254, and
answer differently a second later. And the registry steers skopeo further
than its own name: a redirect, a token realm or a foreign layer's URL may
name any address, loopback included, which Go never sends through a proxy.

So a guarded pull (NodeConfig.pull_guard: every node a gateway places on)
runs skopeo in a network namespace of its own, where the only thing it can
reach is this proxy's listening socket (made there, passed out; nothing
else listens, and nothing routes out). The proxy answers CONNECT only,
resolves every name itself, refuses when any address it gets is inside
(`outside`), and connects, from the node's namespace, only to an address it
checked.

CORRAL_REGISTRIES (HOST[:PORT], comma-separated; the gateway reads it to
limit which registries a create may name) also names the registries the
guard lets through wherever they resolve: an operator's own registry on a
private address.
"""

from __future__ import annotations

import base64
import concurrent.futures
import ctypes
import fcntl
import ipaddress
import os
import secrets
import selectors
import socket
import struct
import subprocess
import threading
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

from corral.addresses import Network, host_port, inside_name, outside
from corral.errors import Unavailable
from corral.log import get_logger

log = get_logger("corral.images")

# The proxy's port in the pull's own network namespace, free by construction.
PROXY_PORT = 3128
HEAD_MAX = 8192  # a CONNECT request's head
CONNECT_TIMEOUT = 15.0  # the head, the name's resolution, the upstream connect: each
IDLE_TIMEOUT = 300.0  # a tunnel with no byte either way for this long is closed
TUNNELS = 32  # at once, per pull (skopeo opens a few)
PIPE_BYTES = 1 << 20  # each direction's buffer: a tunnel's bytes move by splice(2)
RECV_BYTES = 1 << 16  # a copy past urgent data, at most a pipe's smallest size
STALLS = 1000  # readable wake-ups in a row that read nothing: the tunnel is dropped
_SPLICE_FLAGS = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
Resolver = Callable[[str, int], list[str]]

_libc = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def allowed_registries() -> list[str]:
    """CORRAL_REGISTRIES: the registries a cluster pulls from, if listed."""
    return [h.strip() for h in os.environ.get("CORRAL_REGISTRIES", "").split(",") if h.strip()]


def _resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


class Unresolved(Exception):
    """A name the guard could not resolve (not a refusal: the registry is
    unreachable, as it would be unguarded)."""


class PullGuard:
    """One pull's proxy (a context manager): `spawn` runs skopeo behind it;
    `refused` says what it refused and `unresolved` what it could not
    resolve, for the pull's error."""

    def __init__(self, deny: Iterable[str] = (), resolve: Resolver = _resolve) -> None:
        self.deny: list[Network] = [ipaddress.ip_network(n, strict=False) for n in deny]
        self.allowed = {host_port(h) for h in allowed_registries()}
        self.resolve = resolve
        self.refused: list[str] = []
        self.unresolved: list[str] = []
        self._token = secrets.token_urlsafe(24)
        self._listener: socket.socket | None = None
        self._slots = threading.BoundedSemaphore(TUNNELS)
        # This pull's own: a registry whose names resolve slowly holds up
        # only its own pull's lookups.
        self._resolvers = concurrent.futures.ThreadPoolExecutor(4, "pull-guard-dns")
        self._open: set[socket.socket] = set()

    # ------------------------------------------------------------ policy

    def check_name(self, host: str, port: int) -> bool:
        """Whether `host`:`port` is a listed registry; PermissionError where
        its name alone is inside (no resolver asked)."""
        name = host.lower().rstrip(".")
        listed = (name, port) in self.allowed
        if not listed and inside_name(name):
            raise PermissionError(f"{host} names an address inside the cluster's network")
        return listed

    def check(self, host: str, port: int) -> list[str]:
        """The addresses `host`:`port` may be reached at; PermissionError
        (with the reason, which names no address: a tenant sees it) where
        any address it has is inside; Unresolved where it has none."""
        name = host.lower().rstrip(".")
        listed = self.check_name(host, port)
        future = self._resolvers.submit(self.resolve, name, port)
        try:
            addresses = future.result(CONNECT_TIMEOUT)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise Unresolved(f"{host} did not resolve in {CONNECT_TIMEOUT:g} s") from None
        except (OSError, UnicodeError):
            addresses = []
        if not addresses:
            raise Unresolved(f"{host} resolves to no address")
        if not listed:
            for text in addresses:
                if not outside(ipaddress.ip_address(text.split("%")[0]), self.deny):
                    log.warning("image.pull_inside", host=host, port=port, address=text)
                    raise PermissionError(
                        f"{host} resolves to an address inside the cluster's network"
                    )
        return addresses

    # ------------------------------------------------------------- proxy

    @property
    def env(self) -> dict[str, str]:
        """skopeo's environment additions: every request through the proxy
        (Go's net/http reads both spellings; NO_PROXY must exempt nothing)."""
        url = f"http://corral:{self._token}@127.0.0.1:{PROXY_PORT}"
        return {"HTTPS_PROXY": url, "https_proxy": url, "HTTP_PROXY": url, "http_proxy": url,
                "NO_PROXY": "", "no_proxy": ""}  # fmt: skip

    def spawn(self, argv: list[str], **popen: Any) -> subprocess.Popen[str]:
        """`argv` in a network namespace of its own whose only way out is
        this proxy (its listening socket is made there and passed out)."""
        ours, theirs = socket.socketpair()
        with ours, theirs:
            try:
                # preexec_fn, as runtimes/vm does: system calls only.
                proc = subprocess.Popen(
                    argv,
                    env={**os.environ, **self.env},
                    preexec_fn=lambda: _isolate(theirs),
                    **popen,
                )
            except subprocess.SubprocessError as exc:
                raise Unavailable(
                    f"a guarded pull needs a network namespace of its own: {exc}"
                ) from None
            ours.settimeout(CONNECT_TIMEOUT)
            try:
                _, fds, _, _ = socket.recv_fds(ours, 1, 1)
                if not fds:
                    raise OSError("the pull's child sent no listener")
            except OSError as exc:
                proc.kill()
                proc.communicate()
                raise Unavailable(f"a guarded pull's proxy did not start: {exc}") from None
        os.set_inheritable(fds[0], False)
        self.serve(socket.socket(fileno=fds[0]))
        return proc

    def serve(self, listener: socket.socket) -> None:
        """Answer CONNECTs on `listener` until the guard is closed."""
        self._listener = listener

        def accept() -> None:
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return  # closed
                if not self._slots.acquire(blocking=False):
                    conn.close()
                    continue
                threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

        threading.Thread(target=accept, name="pull-guard", daemon=True).start()

    def __enter__(self) -> PullGuard:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # The listener (its accept() wakes) and every tunnel still open: a
        # silent upstream must not outlive the pull.
        for sock in [*([self._listener] if self._listener else []), *list(self._open)]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._listener is not None:
            self._listener.close()
        self._resolvers.shutdown(wait=False, cancel_futures=True)

    def _serve(self, client: socket.socket) -> None:
        client.settimeout(CONNECT_TIMEOUT)
        self._open.add(client)
        try:
            self._tunnel(client)
        except (OSError, ValueError, UnicodeError):
            pass  # a client gone, or not a CONNECT: nothing is forwarded
        finally:
            self._open.discard(client)
            client.close()
            self._slots.release()

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
        except Unresolved as exc:
            self.unresolved.append(str(exc))
            _answer(client, 502, "Bad Gateway")
            return
        upstream = _connect(addresses, port)
        if upstream is None:
            _answer(client, 502, "Bad Gateway")
            return
        self._open.add(upstream)
        try:
            client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            _splice(client, upstream)
        finally:
            self._open.discard(upstream)
            upstream.close()

    def _target(self, head: bytes) -> tuple[str, int] | None:
        """(host, port) of an authenticated CONNECT; None: not authenticated.
        ValueError: not a CONNECT (plain HTTP is never forwarded)."""
        lines = head.split(b"\r\n")
        method, target, _ = lines[0].split(b" ", 2)
        if method != b"CONNECT":
            raise ValueError("only CONNECT")
        want = b"Basic " + base64.b64encode(f"corral:{self._token}".encode())
        given = [v.strip() for k, _, v in (x.partition(b":") for x in lines[1:])
                 if k.strip().lower() == b"proxy-authorization"]  # fmt: skip
        if not given or not secrets.compare_digest(given[0], want):
            return None
        host, _, port = target.decode("ascii").rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        number = int(port)
        if not host or not 0 < number < 65536:
            raise ValueError("bad target")
        return host, number


def _isolate(channel: socket.socket) -> None:
    """In the pull's child, before exec: a network namespace of its own,
    its loopback up, the proxy's listening socket made there and sent to
    the parent. System calls only (the parent may have threads)."""
    if _libc.unshare(CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNET)")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        raw = fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sH14x", b"lo", 0))
        flags = struct.unpack_from("16sH", raw)[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", PROXY_PORT))
        listener.listen(64)
        socket.send_fds(channel, [b"L"], [listener.fileno()])


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


class _Flow:
    """One direction of a tunnel: bytes from `src` go into a pipe and from
    the pipe to `dst` by splice(2), never through this process's memory.
    `pending` bytes sit in the pipe; while any do, `src` is not read (the
    pipe is the direction's whole buffer, so a peer that stops reading
    stops its sender)."""

    def __init__(self, src: socket.socket, dst: socket.socket) -> None:
        self.src, self.dst = src, dst
        self.out, self.into = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            fcntl.fcntl(self.into, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        except OSError:
            pass  # past pipe-max-size, or the user's pipe pages: what it has does
        self.room = fcntl.fcntl(self.into, fcntl.F_GETPIPE_SZ)  # 4 KiB, at the least
        self.idle_reads = 0  # readable wake-ups in a row that moved nothing
        self.pending = 0
        self.ended = False

    def pull(self) -> None:
        """`src` is readable: move what it has through the pipe to `dst`
        until either would block; at `src`'s end, pass the half close on.
        splice(2) stops short of TCP urgent data while the socket stays
        readable: a first splice that moves nothing is followed by one
        recv(), which steps past it (else a peer's urgent byte would spin
        this loop for the rest of the pull, or end it early)."""
        first = True
        while not self.pending:
            try:
                n = os.splice(self.src.fileno(), self.into, PIPE_BYTES, flags=_SPLICE_FLAGS)
            except BlockingIOError:
                if not first:
                    return
                n = 0
            if n == 0:
                # Nothing spliced: the end, or urgent data (where splice
                # answers 0 once the peer has closed, else EAGAIN). recv()
                # tells them apart, and steps past the urgent byte.
                try:
                    data = self.src.recv(min(RECV_BYTES, self.room))
                except BlockingIOError:
                    self.idle_reads += 1
                    return
                # The pipe is empty and holds `room`: the whole of it, at once.
                n = os.write(self.into, data) if data else 0
                if n != len(data):
                    raise OSError(f"a pipe of {self.room} bytes took {n} of {len(data)}")
            first = False
            self.idle_reads = 0
            if n == 0:
                self.ended = True
                try:
                    self.dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            self.pending = n
            self.push()

    def push(self) -> None:
        """Move what the pipe holds to `dst`, as far as it takes now."""
        while self.pending:
            try:
                n = os.splice(self.out, self.dst.fileno(), self.pending, flags=_SPLICE_FLAGS)
            except BlockingIOError:
                return
            self.pending -= n

    def close(self) -> None:
        os.close(self.out)
        os.close(self.into)


def _splice(a: socket.socket, b: socket.socket) -> None:
    """Bytes both ways until both sides have ended (or nothing moved either
    way for IDLE_TIMEOUT: a silent peer, or one that stopped reading); an
    end on one side is passed on as a half close."""
    a.setblocking(False)
    b.setblocking(False)
    flows: list[_Flow] = []
    try:
        flows.append(_Flow(a, b))
        flows.append(_Flow(b, a))
        with selectors.DefaultSelector() as sel:
            while not all(f.ended and not f.pending for f in flows):
                if any(f.idle_reads > STALLS for f in flows):
                    log.warning("image.pull_tunnel_stalled", wakeups=STALLS)
                    return  # readable, and nothing to read: never spin
                wants: dict[socket.socket, int] = {}
                for f in flows:
                    if f.pending:
                        wants[f.dst] = wants.get(f.dst, 0) | selectors.EVENT_WRITE
                    elif not f.ended:
                        wants[f.src] = wants.get(f.src, 0) | selectors.EVENT_READ
                for sock in (a, b):
                    _interest(sel, sock, wants.get(sock, 0))
                ready = sel.select(IDLE_TIMEOUT)
                if not ready:
                    return
                events = {key.fileobj: mask for key, mask in ready}
                for f in flows:
                    if f.pending and events.get(f.dst, 0) & selectors.EVENT_WRITE:
                        f.push()
                    elif not f.pending and events.get(f.src, 0) & selectors.EVENT_READ:
                        f.pull()
    finally:
        for f in flows:
            f.close()


def _interest(sel: selectors.BaseSelector, sock: socket.socket, mask: int) -> None:
    try:
        key = sel.get_key(sock)
    except KeyError:
        if mask:
            sel.register(sock, mask)
        return
    if not mask:
        sel.unregister(sock)
    elif key.events != mask:
        sel.modify(sock, mask)
