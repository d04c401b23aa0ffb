"""Stand-in hosts for the network attacks: each in its own network
namespace, serving a tiny package index (one wheel) and an answer file; and
an upstream DNS server that records every name it was asked."""

from __future__ import annotations

import hashlib
import io
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dnslib import RR, A, DNSRecord

# A line echo server beside the web server: a connection that stays open.
ECHO = """import socketserver, sys
class Echo(socketserver.StreamRequestHandler):
    def handle(self):
        for line in self.rfile:
            self.wfile.write(line)
socketserver.ThreadingTCPServer.allow_reuse_address = True
socketserver.ThreadingTCPServer((sys.argv[1], int(sys.argv[2])), Echo).serve_forever()
"""


@dataclass(frozen=True)
class Standin:
    name: str
    host_ip: str
    ip: str
    port: int = 8080
    echo_port: int = 8081

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True)


def _canary_wheel() -> tuple[str, bytes]:
    name = "corral_canary-1.0-py3-none-any.whl"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("corral_canary/__init__.py", 'VALUE = "installed from the stand-in index"\n')
        z.writestr(
            "corral_canary-1.0.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: corral-canary\nVersion: 1.0\n",
        )
        z.writestr(
            "corral_canary-1.0.dist-info/WHEEL",
            "Wheel-Version: 1.0\nGenerator: corral-tests\nRoot-Is-Purelib: true\n"
            "Tag: py3-none-any\n",
        )
        z.writestr("corral_canary-1.0.dist-info/RECORD", "")
    return name, buf.getvalue()


@contextmanager
def standin_hosts(data_root: Path) -> Iterator[dict[str, Standin]]:
    hosts = {
        "index": Standin("crti", "10.212.0.1", "10.212.0.2"),
        "forbidden": Standin("crtf", "10.213.0.1", "10.213.0.2"),
    }
    web = data_root / "standin-web"
    (web / "simple" / "corral-canary").mkdir(parents=True)
    (web / "packages").mkdir()
    wheel, data = _canary_wheel()
    (web / "packages" / wheel).write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    (web / "simple" / "corral-canary" / "index.html").write_text(
        f'<a href="/packages/{wheel}#sha256={digest}">{wheel}</a>\n'
    )
    (web / "answer.txt").write_text("THE-REFERENCE-SOLUTION\n")
    procs = []
    for s in hosts.values():
        subprocess.run(["ip", "netns", "del", s.name], capture_output=True)
        subprocess.run(["ip", "link", "del", s.name + "h"], capture_output=True)
        _sh("ip", "netns", "add", s.name)
        _sh("ip", "link", "add", s.name + "h", "type", "veth", "peer", "name", s.name + "n")
        _sh("ip", "link", "set", s.name + "n", "netns", s.name)
        _sh("ip", "addr", "add", f"{s.host_ip}/24", "dev", s.name + "h")
        _sh("ip", "link", "set", s.name + "h", "up")
        for cmd in (
            ["ip", "addr", "add", f"{s.ip}/24", "dev", s.name + "n"],
            ["ip", "link", "set", s.name + "n", "up"],
            ["ip", "link", "set", "lo", "up"],
            ["ip", "route", "add", "default", "via", s.host_ip],
        ):
            _sh("ip", "netns", "exec", s.name, *cmd)
        procs.append(
            subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    s.name,
                    sys.executable,
                    "-m",
                    "http.server",
                    str(s.port),
                    "--bind",
                    s.ip,
                    "--directory",
                    str(web),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        echo = [sys.executable, "-c", ECHO, s.ip, str(s.echo_port)]
        procs.append(subprocess.Popen(["ip", "netns", "exec", s.name, *echo]))
    for s in hosts.values():
        for port in (s.port, s.echo_port):
            for _ in range(100):
                try:
                    socket.create_connection((s.ip, port), timeout=0.2).close()
                    break
                except OSError:
                    time.sleep(0.05)
    yield hosts
    for p in procs:
        p.kill()
        p.wait()
    for s in hosts.values():
        subprocess.run(["ip", "link", "del", s.name + "h"], capture_output=True)
        subprocess.run(["ip", "netns", "del", s.name], capture_output=True)


class UpstreamDNS:
    """A DNS server that answers everything with 10.213.0.2 and records
    every name it was asked: what leaks past the node's resolver."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.asked: list[str] = []
        self._stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                data, addr = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            q = DNSRecord.parse(data)
            self.asked.append(str(q.q.qname).rstrip("."))
            r = q.reply()
            r.add_answer(RR(q.q.qname, rdata=A("10.213.0.2"), ttl=60))
            self.sock.sendto(r.pack(), addr)

    def close(self) -> None:
        self._stop = True
        self.thread.join()
        self.sock.close()
