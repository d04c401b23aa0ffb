"""corral-netmove (native/corral-netmove.c): a copy's connections to the
outside are aborted, its own loopback ones and its listeners kept, in the
network namespace it is pointed at. Two real namespaces and a veth, as a
copy's namespace and the host it talked to."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

HELPER = Path(__file__).parents[2] / "build" / "platform" / "bin" / "corral-netmove"
COPY, PEER = "cnm-copy", "cnm-peer"

# In the copy's namespace: a connection out, one over loopback (two sockets)
# and a listener; after the helper ran (stdin closes), both are used.
HOLDER = r"""
import socket, sys
out = socket.create_connection(("10.78.0.2", 9000))
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()
loop = socket.create_connection(listener.getsockname())
peer, _ = listener.accept()
print("ready", flush=True)
sys.stdin.read()
try:
    out.sendall(b"x")
    out.recv(1)
    print("outside: alive")
except OSError as e:
    print("outside:", type(e).__name__)
loop.sendall(b"y")
print("loopback:", peer.recv(1).decode())
"""
SERVER = r"""
import socket, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("10.78.0.2", 9000))
s.listen()
print("listening", flush=True)
c, _ = s.accept()
time.sleep(30)
"""


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture
def namespaces() -> Iterator[None]:
    for ns in (COPY, PEER):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    _sh("ip", "netns", "add", COPY)
    _sh("ip", "netns", "add", PEER)
    try:
        _sh("ip", "-n", COPY, "link", "add", "cnm0", "type", "veth", "peer", "name", "cnm1",
            "netns", PEER)  # fmt: skip
        for ns, dev, addr in ((COPY, "cnm0", "10.78.0.1/24"), (PEER, "cnm1", "10.78.0.2/24")):
            _sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield
    finally:
        for ns in (COPY, PEER):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_a_copys_connections_out_are_aborted_and_its_own_kept(namespaces: None) -> None:
    server = subprocess.Popen(
        ["ip", "netns", "exec", PEER, sys.executable, "-c", SERVER], stdout=subprocess.PIPE
    )
    holder = None
    try:
        assert server.stdout is not None and server.stdout.readline() == b"listening\n"
        holder = subprocess.Popen(
            ["ip", "netns", "exec", COPY, sys.executable, "-c", HOLDER],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        done = subprocess.run(
            [str(HELPER), "--netns-of", str(holder.pid)], capture_output=True, text=True,
            timeout=10,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        # One aborted; the loopback pair kept (the listener is not counted).
        assert done.stdout == "1 2\n"
        out, _ = holder.communicate("", timeout=10)
        assert out.splitlines() == ["outside: ConnectionAbortedError", "loopback: y"]
        again = subprocess.run([str(HELPER), "--netns-of", str(holder.pid)], capture_output=True)
        assert again.returncode != 0  # the holder is gone: no namespace to enter
    finally:
        for p in (server, holder):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_with_nothing_to_abort_it_aborts_nothing(namespaces: None) -> None:
    sleeper = subprocess.Popen(["ip", "netns", "exec", COPY, "sleep", "30"])
    try:
        for _ in range(100):  # until `ip netns exec` has exec'd sleep in the namespace
            if Path(f"/proc/{sleeper.pid}/comm").read_text().strip() == "sleep":
                break
            time.sleep(0.02)
        done = subprocess.run(
            [str(HELPER), "--netns-of", str(sleeper.pid)], capture_output=True, text=True
        )
        assert (done.returncode, done.stdout) == (0, "0 0\n"), done.stderr
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize(("args", "code", "said"), [
    (["--netns-of"], 2, "usage: corral-netmove"),              # no pid
    (["--netns-of", "abc"], 2, "not a pid: abc"),               # not a number
    (["--netns-of", "12x"], 2, "not a pid: 12x"),               # trailing junk
    (["--netns-of", "-5"], 2, "not a pid: -5"),                 # negative
    (["--netns-of", ""], 2, "not a pid: "),                     # empty
    (["--netns-of", "999999999"], 1, "/proc/999999999/ns/net"),  # no such process
    (["--other"], 2, "usage: corral-netmove"),                  # unknown option
])  # fmt: skip
def test_netmove_refuses_bad_arguments(args: list[str], code: int, said: str) -> None:
    done = subprocess.run([str(HELPER), *args], capture_output=True, text=True, timeout=10)
    assert done.returncode == code and said in done.stderr, done.stderr
    assert done.stdout == ""
