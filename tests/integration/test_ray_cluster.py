"""`corral cluster up` on a local Ray cluster of 3 nodes, as a user runs it:
node agents are detached, named actors pinned to their Ray nodes; one that
dies is restarted by Ray and finds its sandboxes again; `cluster down`
leaves nothing running or mounted."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import corral
from corral.cluster import localray
from corral.host import mounts

from ..framework import IMAGE, free_port

pytestmark = [pytest.mark.slow, pytest.mark.requires_ray, pytest.mark.requires_postgres]


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "corral.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _free_run(n: int) -> int:
    """The first of n consecutive free ports, below the kernel's ephemeral
    range and above Ray's worker ports (10002-19999). One picked from the
    ephemeral range could be taken by any bind to port 0 before the node
    agent bound it: a CI run saw a node's port answer with aiohttp's
    "404: Not Found" (a Ray process's server), and that node never
    reported in."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    while True:
        base = rng.randrange(20000, max(20001, low - n))
        if all(_is_free(base + i) for i in range(n)):
            return base


def _is_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _listener(port: int) -> int:
    """The pid listening on a TCP port (the node agent's actor process)."""
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True)
    return int(out.stdout.split("pid=")[1].split(",")[0])


@pytest.fixture(scope="module")
def ray_cluster(data_root: Path) -> Iterator[dict[str, object]]:
    directory = data_root / "ray"
    up = _cli(
        # As the README's quick start: no --images (the nodes fetch what
        # they lack from this machine's image store).
        "cluster", "up", "--local-nodes", "3", "--dir", str(directory), "--node-timeout", "5",
        "--ray-port", str(free_port()), "--pg-port", str(free_port()),
        "--gateway-port", str(free_port()), "--node-port", str(_free_run(3)),
        "--dns-port", str(_free_run(3)),
    )  # fmt: skip
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        doc = json.loads((directory / "cluster.json").read_text())
        assert oct((directory / "cluster.json").stat().st_mode & 0o777) == "0o600"
        yield {**doc, "dir": directory}
    finally:
        down = _cli("cluster", "down", "--dir", str(directory))
        print(down.stdout, down.stderr)
    assert down.returncode == 0, down.stdout + down.stderr
    assert not (directory / "cluster.json").exists()
    assert mounts.mounts_under(directory) == []
    assert localray.processes(directory) == []  # this cluster's Ray, and only it
    assert subprocess.run(["pgrep", "-f", f"postgres -D {directory}"]).returncode == 1


def test_cluster_up_runs_three_node_agents_that_report_in(
    ray_cluster: dict[str, object],
) -> None:
    status = _cli("--json", "cluster", "status", "--dir", str(ray_cluster["dir"]))
    assert status.returncode == 0, status.stderr
    rows = json.loads(status.stdout)
    assert sorted(r["name"] for r in rows) == ["n0", "n1", "n2"]
    assert {r["state"] for r in rows} == {"alive"}


async def test_a_killed_node_agent_is_restarted_by_ray_and_keeps_its_sandboxes(
    ray_cluster: dict[str, object],
) -> None:
    gateway, key = str(ray_cluster["gateway"]), str(ray_cluster["api_key"])
    urls = ray_cluster["nodes"]
    assert isinstance(urls, dict)
    async with corral.AsyncClient(gateway, api_key=key) as c:
        made = await c.sandboxes.create_many({"image": IMAGE, "memory": "256MiB"}, count=6)
        sbxs = [s for s in made if isinstance(s, corral.AsyncSandbox)]
        assert len(sbxs) == 6, made
        assert len({s.id.split("-")[0] for s in sbxs}) >= 2
        victim = sbxs[0]
        await victim.files.write("/tmp/kept", b"survives its agent")
        node = victim.id.split("-")[0]
        pid = _listener(int(urls[node].rsplit(":", 1)[1]))
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        while True:
            try:
                assert await victim.files.read("/tmp/kept") == b"survives its agent"
                break
            except corral.Unavailable:
                assert time.monotonic() - killed < 90, "Ray did not restart the node agent"
                await asyncio.sleep(0.5)
        assert _listener(int(urls[node].rsplit(":", 1)[1])) != pid  # a new process
        # Its neighbours never noticed.
        for s in sbxs[1:]:
            assert (await s.commands.run("true")).exit_code == 0
        await asyncio.gather(*(s.close() for s in sbxs))
