"""Fixtures of the adversarial suite: a node with networking, stand-in
hosts in their own network namespaces (a package index, a host nobody may
reach), a recording upstream DNS server, an attacker and a neighbour."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import corral
from corral.config import NodeConfig
from corral.images.build import build_from_dir
from corral.images.store import ImageStore

from ..framework import IMAGE, agent_of
from .attacks import Neighbour
from .standins import Standin, UpstreamDNS, standin_hosts

PIP_TOOLKIT = "pip:24.2"


@pytest.fixture(scope="session")
def standins(data_root: Path) -> Iterator[dict[str, Standin]]:
    with standin_hosts(data_root) as hosts:
        yield hosts


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


ATTACKER: dict[str, Any] = {
    "image": IMAGE, "cpu": 0.5, "memory": "128MiB", "pids": 64, "disk": "64MiB",
    "labels": {"role": "attacker"},
}  # fmt: skip


@pytest.fixture(params=["cold", "warm"])
async def attacker(
    request: pytest.FixtureRequest, rt_client: corral.AsyncClient, rt_config: NodeConfig
) -> AsyncIterator[corral.AsyncSandbox]:
    """The attacker's sandbox, started cold, or claimed from a warm pool
    (node/warmpool.py) by a second agent of the node: every attack runs
    against both, and the guard must hold alike."""
    if request.param == "cold":
        yield await rt_client.sandboxes.create(**ATTACKER)
        return
    async with corral.AsyncClient(config=replace(rt_config, warm_pool=1)) as pooled:
        pool = agent_of(pooled).parts.warm
        await (await pooled.sandboxes.create(image=IMAGE, memory="64MiB")).close()  # demand
        for _ in range(600):
            if pool.held() and not sum(pool._making.values()):
                break
            await asyncio.sleep(0.05)
        warm = {i for q in pool._ready.values() for i in q}
        claimed = await pooled.sandboxes.create(**ATTACKER)
        assert claimed.id in warm, "the attacker was not claimed from the warm pool"
        yield await rt_client.sandboxes.get(claimed.id)


@pytest.fixture(autouse=True)
def _no_stray_host_files() -> Iterator[None]:
    yield
    assert not Path("/tmp/corral-pwned").exists(), "an attack wrote on the host"
    if os.path.exists("/tmp/corral-pwned"):
        os.unlink("/tmp/corral-pwned")
