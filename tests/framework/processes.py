"""Processes the suites start, as a user would: `corral serve` for a node
(Server) or as the gateway (GatewayProcess), and helpers to run coroutines
and find free ports."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import IO, Any, TypeVar

import httpx

from corral.config import NodeConfig

T = TypeVar("T")
CORRAL = [sys.executable, "-m", "corral.cli.main"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` to completion from sync or async code (on its own thread
    and loop, so it works inside a running event loop too)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def node_env(config: NodeConfig, **extra: str) -> dict[str, str]:
    """The environment a corral command of this node runs with (the rest
    of the config travels as flags or is the default)."""
    return dict(
        os.environ,
        CORRAL_NODE=config.node,
        CORRAL_IMAGES=str(config.images_dir),
        CORRAL_SCRATCH_SIZE=str(config.scratch_size),
        CORRAL_REAPER_INTERVAL=str(config.reaper_interval),
        **extra,
    )


class Server:
    """A `corral serve` process for one node, on a unix socket (and a TCP
    port for clients that speak plain HTTP only). It can be started again
    after a stop or a kill, on the same socket and port."""

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
        self.log_path = sock.with_suffix(".log")
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix:{self.sock}"

    @property
    def tcp_url(self) -> str:
        """For clients that speak plain HTTP only (SandboxFusion's)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        assert not self.running, "corral serve is running already"
        self.sock.unlink(missing_ok=True)
        self._close_log()
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (held while it runs)
        self.proc = subprocess.Popen(
            [
                *CORRAL,
                "--data-dir", str(self.config.data_dir),
                "serve",
                "--port", str(self.port),
                "--socket", str(self.sock),
                "--log-level", "warning",
                *self.args,
            ],
            env=node_env(self.config, **self.env),
            stdout=self._log,
            stderr=self._log,
        )  # fmt: skip
        # ~1 s here; tens of seconds in tests/framework/v2host.py's TCG guest.
        deadline = time.monotonic() + 120
        while not self.sock.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"corral serve did not start; see {self.log_path}")
            time.sleep(0.05)

    def send(self, sig: int) -> None:
        """Send a signal and return at once (SIGSTOP, SIGCONT)."""
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send a signal and wait for the process to exit."""
        assert self.proc is not None
        self.proc.send_signal(sig)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.running:
            self.kill(signal.SIGTERM)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


class GatewayProcess:
    """A `corral serve --gateway` process on a TCP port."""

    def __init__(
        self,
        state: str,
        node_key: str,
        node_timeout: float,
        log: Path,
        args: list[str] | None = None,
    ) -> None:
        self.args = list(args or [])
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
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    *CORRAL, "serve", "--gateway",
                    "--state", self.state, "--port", str(self.port),
                    "--node-timeout", str(self.node_timeout), "--log-level", "warning",
                    *self.args,
                ],
                env=dict(os.environ, CORRAL_NODE_KEY=self.node_key),
                stdout=log,
                stderr=log,
            )  # fmt: skip
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
