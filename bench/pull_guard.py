"""What the egress guard of a cluster node's registry pulls costs
(images/egress.py): its CONNECT tunnel against a direct connection.

    corral bench pull_guard [--mib 512] [--n 300]

Two measures, each side by side with the peer (a direct TCP connection,
what an unguarded node's skopeo makes): the time to a usable connection
(connect, and through the guard its CONNECT, name check and upstream
connect, then one byte each way), and the throughput of a blob download
(a local server sends --mib MiB and closes). Both on loopback, so the
tunnel's own cost is all that differs; a real registry is further away.
"""

from __future__ import annotations

import argparse
import base64
import multiprocessing
import os
import socket
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import median, pct, table, write_result  # noqa: E402
from corral.images.egress import PullGuard  # noqa: E402

NAME = "blobs.bench"


def _server(size: int) -> tuple[socket.socket, int]:
    """A server that answers a 1-byte ping with one byte, or sends `size`
    bytes to a client that sends 'B', then closes."""
    server = socket.create_server(("127.0.0.1", 0), backlog=128)
    payload = os.urandom(1 << 20)

    def one(conn: socket.socket) -> None:
        with conn:
            what = conn.recv(1)
            if what == b"B":
                left = size
                while left > 0:
                    left -= conn.send(payload[: min(left, len(payload))])
            elif what:
                conn.sendall(b"k")

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=one, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


GUARD_PORT = 0  # where the guard answers (a pull's is in its own namespace)


def _guard(listener: socket.socket, creds: Connection) -> None:
    """The guard, in a process of its own as on a node (skopeo and the
    registry are other processes): the bench's client and server threads do
    not share its interpreter lock."""
    with PullGuard(resolve=lambda host, _: ["127.0.0.1"] if host == NAME else []) as guard:
        guard.serve(listener)
        creds.send(guard.env["HTTPS_PROXY"].removeprefix("http://").partition("@")[0])
        creds.recv()  # until the bench is done


def _open(creds: str | None, port: int) -> socket.socket:
    if creds is None:
        return socket.create_connection(("127.0.0.1", port))
    sock = socket.create_connection(("127.0.0.1", GUARD_PORT))
    auth = base64.b64encode(creds.encode()).decode()
    sock.sendall(f"CONNECT {NAME}:{port} HTTP/1.1\r\nProxy-Authorization: Basic {auth}\r\n\r\n"
                 .encode())  # fmt: skip
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += sock.recv(256)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    return sock


def _setup(creds: str | None, port: int) -> float:
    t0 = time.perf_counter()
    with _open(creds, port) as sock:
        sock.sendall(b"p")
        assert sock.recv(1) == b"k"
    return time.perf_counter() - t0


def _download(creds: str | None, port: int) -> float:
    """MiB/s of one blob download."""
    t0 = time.perf_counter()
    got = 0
    with _open(creds, port) as sock:
        sock.sendall(b"B")
        while data := sock.recv(1 << 20):
            got += len(data)
    return got / (1 << 20) / (time.perf_counter() - t0)


def main(mib: int, n: int) -> None:
    server, port = _server(mib << 20)
    os.environ["CORRAL_REGISTRIES"] = f"{NAME}:{port}"  # a listed mirror, on loopback
    global GUARD_PORT
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    GUARD_PORT = listener.getsockname()[1]
    ours, theirs = multiprocessing.get_context("fork").Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_guard, args=(listener, theirs))
    proc.start()
    try:
        guard = ours.recv()
        for _ in range(20):  # warm both paths
            _setup(None, port), _setup(guard, port)
        direct, guarded = [], []
        for _ in range(n):  # interleaved: both see the same machine
            direct.append(_setup(None, port))
            guarded.append(_setup(guard, port))
        rates: dict[str, list[float]] = {"direct": [], "guard": []}
        for _ in range(5):
            rates["direct"].append(_download(None, port))
            rates["guard"].append(_download(guard, port))
    finally:
        ours.send("done")
        proc.join(10)
        proc.kill()
        listener.close()
    server.close()
    ms = [
        ["direct TCP (peer: an unguarded node)", f"{median(direct) * 1e3:.3f}",
         f"{pct(direct, 99) * 1e3:.3f}", "1.00x"],
        ["through the guard", f"{median(guarded) * 1e3:.3f}", f"{pct(guarded, 99) * 1e3:.3f}",
         f"{median(guarded) / median(direct):.2f}x"],
    ]  # fmt: skip
    mbs = [
        ["direct TCP (peer)", f"{median(rates['direct']):.0f}", f"{min(rates['direct']):.0f}",
         "1.00x"],
        ["through the guard", f"{median(rates['guard']):.0f}", f"{min(rates['guard']):.0f}",
         f"{median(rates['guard']) / median(rates['direct']):.2f}x"],
    ]  # fmt: skip
    path = write_result(
        "pull_guard",
        "The egress guard of a cluster node's registry pulls",
        [
            f"Time to a usable connection (connect, then one byte each way), {n} of each, "
            "interleaved (ms):\n\n" + table(["", "p50", "p99", "vs peer"], ms),
            f"A {mib} MiB blob download, 5 of each (MiB/s):\n\n"
            + table(["", "median", "slowest", "vs peer"], mbs),
            "The guard runs in a process of its own, as on a node; the clients and the "
            "server share the bench's. Both on loopback: the tunnel's own cost, its bytes "
            "moved by splice(2). The guard's name check is a resolver call (here answered "
            "in its process; a real one adds the resolver's time, once per connection). "
            "skopeo opens a few connections per pull and downloads each blob over one.",
        ],
    )
    print(path.read_text())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--n", type=int, default=300)
    args = parser.parse_args()
    main(args.mib, args.n)
