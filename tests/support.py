"""Helpers of the suites that run real sandboxes: processes they start
(`corral serve`, `corral blobd`) and what a node holds (for leak checks)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import corral
from corral.config import NodeConfig
from corral.node import mounts

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


class Server:
    """A `corral serve` process on a unix socket."""

    def __init__(self, config: NodeConfig, sock: Path, env: dict[str, str] | None = None) -> None:
        self.config = config
        self.sock = sock
        self.env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]

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
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
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
    from corral.node.cgroups import Cgroups

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
