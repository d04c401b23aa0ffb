"""`corral cluster up` and `down` when things go wrong (docs/cluster.md):
a port already taken or a directory PostgreSQL cannot enter is refused
before anything starts; an `up` that fails half-way stops what it started;
an `up` killed at any step leaves nothing `down` cannot find and stop; and
`down` never stops a Ray it did not start."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.cluster import localray
from corral.host import mounts

from ..framework import IMAGES, free_port

pytestmark = [pytest.mark.slow, pytest.mark.requires_ray, pytest.mark.requires_postgres]
CORRAL = [sys.executable, "-m", "corral.cli.main"]


def _ports() -> list[str]:
    node = free_port()
    while not all(_free(node + i) for i in range(2)):
        node = free_port()
    ray = free_port()
    while not _free(ray + 1):
        ray = free_port()
    dns = free_port()
    while not all(_free(dns + i) and _free(dns + i, udp=True) for i in range(2)):
        dns = free_port()
    return [
        "--ray-port", str(ray), "--pg-port", str(free_port()), "--dns-port", str(dns),
        "--gateway-port", str(free_port()), "--node-port", str(node),
    ]  # fmt: skip


def _free(port: int, udp: bool = False) -> bool:
    with socket.socket(type=socket.SOCK_DGRAM if udp else socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CORRAL, *args], capture_output=True, text=True, timeout=timeout)


def _nothing_left(directory: Path) -> None:
    assert not (directory / "cluster.json").exists()
    assert localray.processes(directory) == []
    assert mounts.mounts_under(directory) == []
    pg = subprocess.run(["pgrep", "-f", f"postgres -D {directory}"], capture_output=True)
    assert pg.returncode == 1, pg.stdout


@pytest.fixture(scope="module")
def users_ray(data_root: Path) -> Iterator[int]:
    """A Ray of the user's own on this machine: `down` must leave it be."""
    home = data_root / "users"  # its --temp-dir is home/ray, as localray's are
    temp = localray.temp_dir(home)
    port = free_port()
    subprocess.run(
        [localray.ray_bin(), "start", "--head", f"--port={port}", f"--temp-dir={temp}",
         "--include-dashboard=false",
         "--num-cpus=1", "--object-store-memory=80000000", "--disable-usage-stats"],
        check=True, capture_output=True, env=localray.ray_env(),
    )  # fmt: skip
    try:
        yield next(p for p in localray.processes(home) if b"gcs_server" in _cmd(p))
    finally:
        localray.stop(home)


def _cmd(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_a_port_in_use_is_refused_before_anything_starts(data_root: Path) -> None:
    directory = data_root / "busy"
    ports = _ports()
    gateway = int(ports[ports.index("--gateway-port") + 1])
    with socket.socket() as held:
        held.bind(("127.0.0.1", gateway))
        held.listen()
        up = _cli("cluster", "up", "--local-nodes", "2", "--dir", str(directory), *ports)
    assert up.returncode != 0
    out = up.stdout + up.stderr
    assert "gateway_port" in out and "in use" in out and str(gateway) in out, out
    assert "Traceback" not in out
    _nothing_left(directory)
    assert not (directory / "pg").exists()


def test_a_dir_postgres_cannot_enter_is_refused_with_the_reason(data_root: Path) -> None:
    closed = data_root / "closed"
    closed.mkdir(mode=0o700, exist_ok=True)
    os.chmod(closed, 0o700)
    up = _cli("cluster", "up", "--local-nodes", "1", "--dir", str(closed / "c"), *_ports())
    out = up.stdout + up.stderr
    assert up.returncode != 0 and "Traceback" not in out, out
    assert "postgres user can enter" in out and f"{closed} is mode 700" in out, out
    _nothing_left(closed / "c")


def test_an_up_that_fails_half_way_stops_what_it_started(data_root: Path) -> None:
    directory = data_root / "halfway"
    # PostgreSQL and Ray start; the node agents cannot (a setting they read
    # from the environment Ray gives them is malformed), so they never
    # heartbeat and `up` gives up waiting.
    argv = [*CORRAL, "cluster", "up", "--local-nodes", "1", "--dir", str(directory),
            "--blobs", str(IMAGES), "--timeout", "20", *_ports()]  # fmt: skip
    env = {**os.environ, "CORRAL_FNCALL_WORKERS": "not-a-number"}
    up = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    if up.returncode == 0:
        _cli("cluster", "down", "--dir", str(directory))
    out = up.stdout + up.stderr
    assert up.returncode != 0 and "Traceback" not in out, out
    assert "cluster up failed while waiting for the node agents" in out, out
    assert "stopping what it started: local_pg, local_ray, actors" in out, out
    _nothing_left(directory)


@pytest.mark.parametrize(
    "step",
    ["starting PostgreSQL", "starting a local Ray", "node agent n0", "waiting for"],
)
def test_an_up_killed_at_any_step_is_stopped_whole_by_down(
    data_root: Path, users_ray: int, step: str
) -> None:
    directory = data_root / f"killed-{step.split()[-1].lower()}"
    ports = _ports()
    proc = subprocess.Popen(
        [*CORRAL, "cluster", "up", "--local-nodes", "2", "--dir", str(directory), *ports],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if step in line:
            time.sleep(0.5)  # into the step, not before it
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert any(step in line for line in seen), seen
    if step == "starting a local Ray":
        # Running `up` again instead: it stops what the killed one left,
        # then starts afresh.
        again = _cli("cluster", "up", "--local-nodes", "2", "--dir", str(directory), *ports)
        out = again.stdout + again.stderr
        assert again.returncode == 0, out
        assert "did not finish: stopping what it started" in out and "cluster up:" in out, out
    down = _cli("cluster", "down", "--dir", str(directory))
    assert down.returncode == 0, down.stdout + down.stderr
    _nothing_left(directory)
    assert Path(f"/proc/{users_ray}").exists(), "down stopped a Ray it did not start"
