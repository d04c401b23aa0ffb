"""Markers by folder and capability, and the fixtures shared by the suites
that run real sandboxes (tests/integration, tests/redteam).

tests/unit are `unit` (no root, no kernel features), tests/integration are
`integration` (root and a real kernel), tests/redteam are `redteam` (attacks
in real sandboxes). A test marked requires_qemu / requires_postgres /
requires_ray skips, naming what is missing, when that is absent here (probes
in tests/framework/capabilities.py). See docs/testing.md.

Every sandbox test gets a node whose data dir belongs to this test session
(tests/framework: Node); the layer store is the one the install script
filled (/var/lib/corral/images), so no test pays for debootstrap. `client`
is parametrized over the two transports: embedded (a node agent in this
process) and http (the SDK against a `corral serve` process sharing the
same node).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

import corral
from corral.config import NodeConfig
from corral.host import mounts, swap

from .framework import IMAGE, IMAGES, Blobd, Node, Server, close_everything, require_image
from .framework.capabilities import REQUIREMENTS, missing_platform

REAL = ("integration", "redteam")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    platform = missing_platform()
    for item in items:
        parts = Path(str(item.fspath)).parts
        for folder in ("unit", "integration", "redteam"):
            if folder in parts:
                item.add_marker(getattr(pytest.mark, folder))
        if platform and any(f in parts for f in REAL):
            item.add_marker(pytest.mark.skip(reason=platform))
        for mark in item.iter_markers():
            # A misspelt requirement would never skip: refuse it.
            if mark.name.startswith("requires_") and mark.name not in REQUIREMENTS:
                raise pytest.UsageError(f"{item.nodeid}: unknown marker {mark.name}")
        for marker, probe in REQUIREMENTS.items():
            # Marks of a fixture's params (pytest.param(..., marks=...)) count too.
            if item.get_closest_marker(marker) is not None and (why := probe()):
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[Any]:
    """A failure's text as it happens: the session's own teardown (closing
    what failed tests left, through C libraries such as libnftables) could
    still crash the process and take pytest's summary with it."""
    report = yield
    if report.failed and (reporter := item.config.pluginmanager.get_plugin("terminalreporter")):
        text = report.longreprtext[-3000:]
        reporter.write_line(f"\nFAILED {item.nodeid} ({report.when}):\n{text}", red=True)
    return report


@pytest.fixture(scope="session")
def data_root() -> Iterator[Path]:
    require_image(IMAGE)
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
    for path in root.glob("*/swap"):  # a node's swap file its agent left on
        swap.disable(path)
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
def node(node_config: NodeConfig, data_root: Path) -> Iterator[Node]:
    """The session's shared node; its server starts with the `server` fixture."""
    n = Node(node_config, sock=data_root / "serve.sock")
    yield n
    n.close()


@pytest.fixture(scope="session")
def server(node: Node) -> Iterator[Server]:
    node.server.start()
    yield node.server
    node.server.stop()


@contextlib.asynccontextmanager
async def _closing_what_it_made(c: corral.AsyncClient) -> AsyncIterator[corral.AsyncClient]:
    started = time.time()
    async with c:
        yield c
        # Whatever a test left open is closed here, not leaked to the next.
        left = [s for s in await c.sandboxes.list() if s.info.created_at >= started]
        await asyncio.gather(*(s.close() for s in left))


@pytest.fixture(params=["embedded", "http"])
async def client(request: pytest.FixtureRequest, node: Node) -> AsyncIterator[corral.AsyncClient]:
    if request.param == "http":
        request.getfixturevalue("server")
        c = node.http_client()
    else:
        c = node.client()
    async with _closing_what_it_made(c) as opened:
        yield opened


@pytest.fixture
async def embedded(node: Node) -> AsyncIterator[corral.AsyncClient]:
    async with _closing_what_it_made(node.client()) as opened:
        yield opened


@pytest.fixture
def fresh_config(
    data_root: Path, node_config: NodeConfig, request: pytest.FixtureRequest
) -> NodeConfig:
    """A node of its own (own data dir and name) for tests that crash agents."""
    name = "f" + str(abs(hash(request.node.nodeid)) % 10**6)
    return replace(node_config, data_dir=data_root / name, node=name)


@pytest.fixture
def fresh_node(fresh_config: NodeConfig) -> Iterator[Node]:
    """fresh_config as a Node; its server (if a test starts it) stops after."""
    n = Node(fresh_config)
    yield n
    n.close()


@pytest.fixture
def blobd(tmp_path: Path) -> Iterator[Blobd]:
    srv = Blobd(tmp_path / "blobstore")
    srv.root.mkdir()
    srv.start()
    yield srv
    srv.kill()
