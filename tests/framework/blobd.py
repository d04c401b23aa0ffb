"""`corral blobd`: the HTTP object store images are pushed to and lazily
pulled from."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx

from .processes import CORRAL, free_port


class Blobd:
    """A `corral blobd` process serving a directory over HTTP; `rate`
    throttles it (a slow store), `port` reuses another one's address."""

    def __init__(self, root: Path, rate: str | None = None, port: int | None = None) -> None:
        self.root = root
        self.rate = rate
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [*CORRAL, "blobd", "--root", str(self.root), "--port", str(self.port)]
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
