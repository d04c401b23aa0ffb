"""Markers by folder and the fixtures shared by the suites that run real
sandboxes (tests/integration, tests/redteam).

tests/unit are `unit` (no root, no kernel features), tests/integration are
`integration` (root and a real kernel), tests/redteam are `redteam` (attacks
in real sandboxes). See docs/testing.md. Every sandbox test gets a client on
a node whose data dir belongs to this test session; the layer store is the
one the install script filled (/var/lib/corral/images), so no test pays for
debootstrap. `client` is parametrized over the two transports: embedded (a
node agent in this process) and http (the SDK against a `corral serve`
process sharing the same node).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

import corral
from corral.config import NodeConfig
from corral.host import mounts

from .support import IMAGE, IMAGES, Blobd, Server, close_everything, missing_capability

REAL = ("integration", "redteam")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    why = missing_capability()
    for item in items:
        parts = Path(str(item.fspath)).parts
        for folder in ("unit", "integration", "redteam"):
            if folder in parts:
                item.add_marker(getattr(pytest.mark, folder))
        if why and any(f in parts for f in REAL):
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def data_root() -> Iterator[Path]:
    if not (IMAGES / "tags" / "debian-python" / "bookworm").exists():
        pytest.fail(f"image {IMAGE} is missing from {IMAGES}: run ./scripts/install.sh")
    root = Path(f"/tmp/ct{os.getpid()}")
    root.mkdir()
    yield root
    # Every agent of the session has stopped: nothing may stay mounted. (A
    # failed test may have left sandboxes open: close them, so that one
    # failure does not leave this machine dirty for the next run.)
    leftover = mounts.mounts_under(root)
    if leftover:
        asyncio.run(close_everything(root))
    for mount_point, _fs, _src in sorted(leftover, reverse=True):
        mounts.umount(mount_point)
    shutil.rmtree(root, ignore_errors=True)
    assert not leftover, f"the test session left mounts behind: {leftover}"


@pytest.fixture(scope="session")
def node_config(data_root: Path) -> NodeConfig:
    return NodeConfig.from_env(
        data_dir=data_root / "node",
        images=IMAGES,
        scratch_size=24 * 2**30,
        node="t",
        reaper_interval=0.2,
    )


@pytest.fixture(scope="session")
def server(node_config: NodeConfig, data_root: Path) -> Iterator[Server]:
    srv = Server(node_config, data_root / "serve.sock")
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(params=["embedded", "http"])
async def client(
    request: pytest.FixtureRequest, node_config: NodeConfig
) -> AsyncIterator[corral.AsyncClient]:
    if request.param == "http":
        srv: Server = request.getfixturevalue("server")
        c = corral.AsyncClient(srv.url)
    else:
        c = corral.AsyncClient(config=node_config)
    started = time.time()
    async with c:
        yield c
        # Whatever a test left open is closed here, not leaked to the next.
        left = [s for s in await c.sandboxes.list() if s.info.created_at >= started]
        await asyncio.gather(*(s.close() for s in left))


@pytest.fixture
async def embedded(node_config: NodeConfig) -> AsyncIterator[corral.AsyncClient]:
    started = time.time()
    async with corral.AsyncClient(config=node_config) as c:
        yield c
        left = [s for s in await c.sandboxes.list() if s.info.created_at >= started]
        await asyncio.gather(*(s.close() for s in left))


@pytest.fixture
def fresh_config(
    data_root: Path, node_config: NodeConfig, request: pytest.FixtureRequest
) -> NodeConfig:
    """A node of its own (own data dir and name) for tests that crash agents."""
    name = "f" + str(abs(hash(request.node.nodeid)) % 10**6)
    return replace(node_config, data_dir=data_root / name, node=name)


@pytest.fixture
def blobd(tmp_path: Path) -> Iterator[Blobd]:
    srv = Blobd(tmp_path / "blobstore")
    srv.root.mkdir()
    srv.start()
    yield srv
    srv.kill()
