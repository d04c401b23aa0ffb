"""Fixtures of the adversarial suite: a node with networking, stand-in
hosts in their own network namespaces (a package index, a host nobody may
reach), a recording upstream DNS server, an attacker and a neighbour."""

from __future__ import annotations

import hashlib
import io
import os
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from dnslib import RR, A, DNSRecord

import corral
from corral.config import NodeConfig
from corral.images.build import build_from_dir
from corral.images.store import ImageStore

from ..support import IMAGE
from .attacks import Neighbour

PIP_TOOLKIT = "pip:24.2"


@dataclass(frozen=True)
class Standin:
    name: str
    host_ip: str
    ip: str
    port: int = 8080

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


@pytest.fixture(scope="session")
def standins(data_root: Path) -> Iterator[dict[str, Standin]]:
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
    for s in hosts.values():
        for _ in range(100):
            try:
                socket.create_connection((s.ip, s.port), timeout=0.2).close()
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


@pytest.fixture(scope="session")
def upstream() -> Iterator[UpstreamDNS]:
    u = UpstreamDNS()
    yield u
    u.close()


@pytest.fixture(scope="session")
def pip_toolkit(node_config: NodeConfig) -> str:
    """A toolkit layer with pip (built once, found by its label after)."""
    store = ImageStore(node_config.images_dir)
    key = "pip:pip==24.2"
    if store.find_by_label("corral.source", key) is None:
        stage = store.tmpdir("pip")
        site = stage / "usr/local/lib/python3.11/dist-packages"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "--target",
                str(site),
                "pip==24.2",
            ],
            check=True,
        )
        build_from_dir(store, stage, tag=PIP_TOOLKIT, kind="toolkit", labels={"corral.source": key})
        subprocess.run(["rm", "-rf", str(stage)], check=True)
    else:
        store.tag(store.find_by_label("corral.source", key).digest, PIP_TOOLKIT)  # type: ignore[union-attr]
    return PIP_TOOLKIT


@pytest.fixture(scope="session")
def rt_config(
    node_config: NodeConfig, data_root: Path, standins: dict[str, Standin], upstream: UpstreamDNS
) -> NodeConfig:
    return replace(
        node_config,
        data_dir=data_root / "rt",
        node="rt",
        network_pool="10.201.0.0/16",
        dns_port=10153,
        dns_upstream=f"127.0.0.1:{upstream.port}",
        dns_hosts={"pypi.test": standins["index"].ip, "answers.test": standins["forbidden"].ip},
        ecosystems={"pypi": ["pypi.test"], "npm": ["registry.npm.test"]},
        liveness_interval=1.0,
        log_quota=64 * 1024,
    )


@pytest.fixture
async def rt_client(rt_config: NodeConfig) -> AsyncIterator[corral.AsyncClient]:
    started = time.time()
    async with corral.AsyncClient(config=rt_config) as c:
        yield c
        for s in await c.sandboxes.list():
            if s.info.created_at >= started:
                await s.close()


@pytest.fixture
async def neighbour(rt_client: corral.AsyncClient) -> AsyncIterator[Neighbour]:
    n = await Neighbour.start(rt_client)
    yield n
    await n.stop()


@pytest.fixture
async def attacker(rt_client: corral.AsyncClient) -> corral.AsyncSandbox:
    return await rt_client.sandboxes.create(
        image=IMAGE, cpu=0.5, memory="128MiB", pids=64, disk="64MiB", labels={"role": "attacker"}
    )


@pytest.fixture(autouse=True)
def _no_stray_host_files() -> Iterator[None]:
    yield
    assert not Path("/tmp/corral-pwned").exists(), "an attack wrote on the host"
    if os.path.exists("/tmp/corral-pwned"):
        os.unlink("/tmp/corral-pwned")
