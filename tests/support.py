"""Helpers of the suites that run real sandboxes: processes they start
(`corral serve`, `corral blobd`) and what a node holds (for leak checks)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import corral
from corral.config import NodeConfig
from corral.host import mounts

T = TypeVar("T")
IMAGES = Path(os.environ.get("CORRAL_TEST_IMAGES", "/var/lib/corral/images"))
IMAGE = "debian-python:bookworm"


def missing_capability() -> str | None:
    if os.geteuid() != 0:
        return "requires root (mount(2), cgroups and namespaces need CAP_SYS_ADMIN)"
    fs = Path("/proc/filesystems").read_text()
    for name in ("overlay", "erofs", "btrfs", "fuse"):
        if name not in fs:
            return f"requires the {name} file system in the kernel (/proc/filesystems)"
    if not shutil.which("crun"):
        return "requires crun on PATH (apt-get install crun)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A `corral serve` process on a unix socket."""

    def __init__(
        self,
        config: NodeConfig,
        sock: Path,
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
    ) -> None:
        self.config = config
        self.sock = sock
        self.env = env or {}
        self.args = args or []
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = free_port()

    @property
    def url(self) -> str:
        return f"unix:{self.sock}"

    @property
    def tcp_url(self) -> str:
        """For clients that speak plain HTTP only (SandboxFusion's)."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = dict(
            os.environ,
            CORRAL_NODE=self.config.node,
            CORRAL_IMAGES=str(self.config.images_dir),
            CORRAL_SCRATCH_SIZE=str(self.config.scratch_size),
            CORRAL_REAPER_INTERVAL=str(self.config.reaper_interval),
            **self.env,
        )
        self.sock.unlink(missing_ok=True)
        self.log = open(self.sock.with_suffix(".log"), "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "corral.cli.main",
                "--data-dir",
                str(self.config.data_dir),
                "serve",
                "--port",
                str(self.port),
                "--socket",
                str(self.sock),
                "--log-level",
                "warning",
                *self.args,
            ],
            env=env,
            stdout=self.log,
            stderr=self.log,
        )
        deadline = time.monotonic() + 30
        while not self.sock.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"corral serve did not start; see {self.log.name}")
            time.sleep(0.05)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.kill(signal.SIGTERM)
        self.log.close()


class Blobd:
    """A `corral blobd` process serving a directory over HTTP."""

    def __init__(self, root: Path, rate: str | None = None) -> None:
        self.root = root
        self.rate = rate
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import httpx

        cmd = [
            sys.executable,
            "-m",
            "corral.cli.main",
            "blobd",
            "--root",
            str(self.root),
            "--port",
            str(self.port),
        ]
        if self.rate:
            cmd += ["--rate", self.rate]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                httpx.get(self.url + "/objects", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("blobd did not start")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def node_leftovers(config: NodeConfig) -> dict[str, int]:
    """What a node holds in the kernel and on disk; all zero when idle."""
    from corral.host.cgroups import Cgroups

    scratch = config.scratch_dir
    return {
        "overlay_mounts_of_node": sum(
            1
            for mp, fs, _src in mounts.mount_table()
            if fs == "overlay" and str(config.data_dir) in mp
        ),
        "sandbox_dirs": len(list(config.sandboxes_dir.glob("*")))
        if config.sandboxes_dir.exists()
        else 0,
        "subvolumes": len([p for p in scratch.iterdir() if p.is_dir()])
        if mounts.is_mounted(scratch)
        else 0,
        "cgroups": len(Cgroups(config.cgroup_parent).present()),
        "sockets": len([p for p in config.run_dir.glob("*.sock") if p.name != "seccomp.sock"])
        if config.run_dir.exists()
        else 0,
        "oci_state": len(list(config.crun_root.glob("*"))) if config.crun_root.exists() else 0,
    }


def init_processes(config: NodeConfig) -> int:
    """corral-init processes whose cgroup belongs to this node."""
    n = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (d / "comm").read_text().strip() != "corral-init":
                continue
            if f"/{config.cgroup_parent}/" in (d / "cgroup").read_text():
                n += 1
        except OSError:
            continue
    return n


async def close_everything(root: Path) -> None:
    """Close every sandbox of every node under root (after a failed test)."""
    for db in root.glob("*/state.db"):
        name = (db.parent / "node").read_text().strip()
        images = db.parent / "images" if (db.parent / "images").exists() else IMAGES
        cfg = NodeConfig.from_env(data_dir=db.parent, node=name, images=images)
        async with corral.AsyncClient(config=cfg) as c:
            for s in await c.sandboxes.list():
                await s.close()


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion from sync or async code (on its own thread
    and loop, so it works inside a running event loop too)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


class GatewayProcess:
    """A `corral serve --gateway` process on a TCP port."""

    def __init__(self, state: str, node_key: str, node_timeout: float, log: Path) -> None:
        self.state = state
        self.node_key = node_key
        self.node_timeout = node_timeout
        self.log_path = log
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import httpx

        log = open(self.log_path, "ab")  # noqa: SIM115
        argv = [
            sys.executable, "-m", "corral.cli.main", "serve", "--gateway",
            "--state", self.state, "--port", str(self.port),
            "--node-timeout", str(self.node_timeout), "--log-level", "warning",
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            argv,
            env=dict(os.environ, CORRAL_NODE_KEY=self.node_key),
            stdout=log,
            stderr=log,
        )
        log.close()
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(self.url + "/healthz", timeout=1)
                return
            except httpx.HTTPError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the gateway did not start; see {self.log_path}") from None
                time.sleep(0.05)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)


class ProcessCluster:
    """A cluster of processes on this machine: a PostgreSQL of its own, node
    agents (`corral serve --state`, each its own data dir, cgroup subtree,
    address pool and DNS port) and a gateway. What the cluster tests and
    bench/cluster.py run; `corral cluster up` runs the same parts under Ray."""

    NODE_KEY = "nk-" + "0" * 8

    def __init__(self, root: Path, nodes: int = 3, node_timeout: float = 3.0) -> None:
        from corral.control.postgres import LocalPostgres

        self.root = root
        self.node_timeout = node_timeout
        self.pg = LocalPostgres(root / "pg", port=free_port())
        self.nodes: list[Server] = []
        for i in range(nodes):
            name = f"k{i}"
            cfg = NodeConfig.from_env(
                data_dir=root / name,
                images=IMAGES,
                scratch_size=16 * 2**30,
                node=name,
                reaper_interval=0.5,
            )
            srv = Server(
                cfg,
                root / f"{name}.sock",
                env={
                    "CORRAL_API_KEY": self.NODE_KEY,
                    "CORRAL_NETWORK_POOL": f"10.{210 + i}.0.0/16",
                    "CORRAL_DNS_PORT": str(10253 + i),
                },
            )
            self.nodes.append(srv)
        self.state = ""
        self.gateway: GatewayProcess | None = None

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)  # PostgreSQL runs as its own user
        self.state = self.pg.start()
        for srv in self.nodes:
            srv.args = ["--state", self.state, "--advertise", srv.tcp_url]
            srv.start()
        self.wait_alive([s.config.node for s in self.nodes])
        self.gateway = GatewayProcess(
            self.state, self.NODE_KEY, self.node_timeout, self.root / "gateway.log"
        )
        self.gateway.start()

    def node_states(self) -> dict[str, str]:
        from corral.control import nodes

        async def go() -> dict[str, str]:
            db = await self.db()
            try:
                return {n.name: n.state for n in await nodes.list_nodes(db)}
            finally:
                await db.aclose()

        return run_sync(go())

    def wait_alive(self, names: list[str], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = self.node_states()
            if all(states.get(n) == "alive" for n in names):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes did not join: {states}")
            time.sleep(0.1)

    async def db(self) -> Any:
        from corral.control.db import connect

        return await connect(self.state)

    def project(self, name: str, parent: str | None = None, **limits: Any) -> str:
        """Create a project; returns an API key of it."""
        from corral.control import quotas

        async def go() -> str:
            db = await self.db()
            try:
                await quotas.create_project(db, name, parent=parent, **limits)
                return await quotas.create_key(db, name)
            finally:
                await db.aclose()

        return run_sync(go())

    def used(self, name: str) -> tuple[int, float, int]:
        from corral.control import quotas

        async def go() -> tuple[int, float, int]:
            db = await self.db()
            try:
                p = await quotas.get_project(db, name)
                return p.used_sandboxes, p.used_cpu, p.used_memory
            finally:
                await db.aclose()

        return run_sync(go())

    def rows(self) -> dict[str, int]:
        """Sandbox rows by state."""

        async def go() -> dict[str, int]:
            db = await self.db()
            try:
                async with db.transaction() as tx:
                    found = await tx.fetchall(
                        "SELECT state, COUNT(*) FROM sandboxes GROUP BY state"
                    )
                return {str(s): int(n) for s, n in found}
            finally:
                await db.aclose()

        return run_sync(go())

    def client(self, key: str, **kw: Any) -> corral.AsyncClient:
        assert self.gateway is not None
        return corral.AsyncClient(self.gateway.url, api_key=key, **kw)

    def node_client(self, srv: Server, *, tcp: bool = False) -> corral.AsyncClient:
        """Straight to a node agent, past the gateway (on its unix socket,
        or on TCP as the gateway reaches it)."""
        return corral.AsyncClient(srv.tcp_url if tcp else srv.url, api_key=self.NODE_KEY)

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.kill(signal.SIGTERM)
        for srv in self.nodes:
            if srv.proc is not None and srv.proc.poll() is None:
                srv.proc.send_signal(signal.SIGCONT)  # a test may have left one stopped
                run_sync(_close_all(self.node_client(srv)))
                srv.stop()
        self.pg.stop()


async def _close_all(client: corral.AsyncClient) -> None:
    async with client as c:
        for s in await c.sandboxes.list():
            try:
                await s.close()
            except corral.CorralError:
                pass  # fncall workers are the node's own


def png_pixels(png: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, rows of RGB bytes) of an 8-bit RGB or RGBA PNG: the
    display tests look at real pixels without an imaging library."""
    import struct
    import zlib

    assert png[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    at, idat, w, h, channels = 8, b"", 0, 0, 3
    while at < len(png):
        (n,) = struct.unpack(">I", png[at : at + 4])
        kind, body = png[at + 4 : at + 8], png[at + 8 : at + 8 + n]
        if kind == b"IHDR":
            w, h, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6), f"unsupported PNG: depth {depth} color {color}"
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        at += 12 + n
    raw = zlib.decompress(idat)
    stride = w * channels
    rows: list[bytes] = []
    prev = bytearray(stride)
    for y in range(h):
        f, line = (
            raw[y * (stride + 1)],
            bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)]),
        )
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b = prev[i]
            if f == 1:
                line[i] = (line[i] + a) & 0xFF
            elif f == 2:
                line[i] = (line[i] + b) & 0xFF
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif f == 4:
                c = prev[i - channels] if i >= channels else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 0xFF
        prev = line
        rgb = bytes(line) if channels == 3 else bytes(v for j, v in enumerate(line) if j % 4 != 3)
        rows.append(rgb)
    return w, h, rows
