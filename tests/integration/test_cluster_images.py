"""Image distribution and the direct path, on a cluster of processes whose
nodes start with empty layer stores and share a blob store (the machine's
image store, as `cluster up` gives local nodes; docs/image-distribution.md,
docs/direct-path.md)."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import corral
from corral.config import NodeConfig
from corral.errors import ImageNotFound, InvalidArgument, SandboxNotFound, Unauthenticated

from ..framework import IMAGE, IMAGES, Cluster, free_port
from ..framework.blobd import Blobd

pytestmark = [pytest.mark.slow, pytest.mark.requires_postgres]
SPEC: dict[str, Any] = {"image": IMAGE, "memory": "256MiB", "cpu": 0.25}
OTHER = "fncall:bookworm"  # another image of the machine's store


@pytest.fixture(scope="module")
def cluster(data_root: Path) -> Iterator[Cluster]:
    # A damaged copy of the shared store for the bad-input cases: a layer
    # manifest that does not match its digest.
    damaged = data_root / "damaged-blobs"
    shutil.rmtree(damaged, ignore_errors=True)
    (damaged / "layers").mkdir(parents=True)
    top = (IMAGES / "tags" / IMAGE.replace(":", "/")).read_text().strip()
    doc = json.loads((IMAGES / "layers" / f"{top.removeprefix('sha256:')}.json").read_text())
    doc["chunk_size"] = doc["chunk_size"] * 2  # part of what the digest covers
    (damaged / "layers" / f"{top.removeprefix('sha256:')}.json").write_text(json.dumps(doc))
    (damaged / "tags" / "evil").mkdir(parents=True)
    (damaged / "tags" / "evil" / "1").write_text(top)
    # The good one last, served over HTTP by `corral blobd`; before it a
    # path that is no store, a store that is down, and the damaged one.
    blobd = Blobd(IMAGES)
    blobd.start()
    down = f"http://127.0.0.1:{free_port()}"
    sources = [str(data_root / "no-such-store"), down, str(damaged), blobd.url]
    c = Cluster(
        data_root / "dist",
        nodes=2,
        prefix="d",
        net_offset=8,
        node_config={"images": None, "image_sources": sources},
    )
    try:
        c.start()
        yield c
    finally:
        c.stop()
        blobd.kill()
    assert {n.name: n.leftovers() for n in c.nodes} == {n.name: {} for n in c.nodes}
    shutil.rmtree(c.root, ignore_errors=True)


@pytest.fixture(scope="module")
def key(cluster: Cluster) -> str:
    return cluster.project("dist")


def _fetches(cluster: Cluster, name: str) -> float:
    """The node's count of images fetched on first use (its /metrics)."""
    node = cluster.node(name)
    text = httpx.get(
        node.server.tcp_url + "/metrics", headers={"authorization": f"Bearer {cluster.NODE_KEY}"}
    ).text
    line = next(x for x in text.splitlines() if x.startswith("corral_image_fetches_total{"))
    assert 'outcome="fetched"' in line, line
    return float(line.rsplit(" ", 1)[1])


async def test_a_node_fetches_an_image_it_lacks_once_and_placement_then_prefers_it(
    cluster: Cluster, key: str
) -> None:
    for n in cluster.nodes:
        assert not (n.config.images_dir / "tags" / IMAGE.replace(":", "/")).exists()
    async with cluster.client(key) as c:
        # Four at once: the node each lands on fetches the image once.
        made = await c.sandboxes.create_many(SPEC, count=4, key="first")
        sbxs = [s for s in made if isinstance(s, corral.AsyncSandbox)]
        assert len(sbxs) == 4, made
        for s in sbxs:
            r = await s.commands.run("python3 -c 'print(6 * 7)'")
            assert (r.exit_code, r.stdout.strip()) == (0, "42")
        # Four creates on two nodes: one node took two or more, and each
        # fetched the image once.
        holders = {s.id.split("-")[0] for s in sbxs}
        for name in holders:
            assert _fetches(cluster, name) == 1
            store = cluster.node(name).config.images_dir
            assert (store / "tags" / IMAGE.replace(":", "/")).exists()
            assert any((store / "origins").iterdir())  # the data is read lazily
        await asyncio.gather(*(s.close() for s in sbxs))
        # Another image, on one node first: once that node has heartbeaten
        # its layers, the next creates of it all go there (by digest).
        other = {**SPEC, "image": OTHER}
        first = await c.sandboxes.create(**other)
        await asyncio.sleep(1.5)
        more = await c.sandboxes.create_many(other, count=4, key="more")
        assert {s.id.split("-")[0] for s in more if isinstance(s, corral.AsyncSandbox)} == {
            first.id.split("-")[0]
        }, more
        await asyncio.gather(
            first.close(), *(s.close() for s in more if isinstance(s, corral.AsyncSandbox))
        )
    assert cluster.used("dist") == (0, 0.0, 0)


@pytest.mark.parametrize(
    ("image", "says"),
    [
        ("nowhere:1", "is not on this node nor in its image sources"),
        ("evil:1", "is damaged"),
    ],
)
async def test_an_image_no_source_has_or_a_damaged_one_is_refused_and_charges_nothing(
    cluster: Cluster, key: str, image: str, says: str
) -> None:
    async with cluster.client(key) as c:
        with pytest.raises(ImageNotFound) as err:
            await c.sandboxes.create(image=image, memory="256MiB")
    msg = err.value.message
    assert says in msg and image in msg, msg
    if image == "nowhere:1":
        assert "image_sources[0]" in msg and "is not a blob store" in msg, msg
        assert "image_sources[1]" in msg and "unreachable" in msg, msg
    assert cluster.used("dist") == (0, 0.0, 0)
    assert cluster.rows().get("placing", 0) == 0


def test_a_misconfigured_image_source_is_refused_at_start() -> None:
    with pytest.raises(InvalidArgument) as err:
        NodeConfig(image_sources=["relative/dir"])
    assert err.value.details["field"] == "image_sources[0]"


async def test_the_direct_path_reaches_the_node_for_one_sandbox_only(
    cluster: Cluster, key: str
) -> None:
    async with cluster.client(key) as c:
        a, b = await c.sandboxes.create(**SPEC), await c.sandboxes.create(**SPEC)
        fast = await a.direct(ttl=60)
        assert fast.id == a.id
        r = await fast.commands.run("echo direct")
        assert (r.exit_code, r.stdout) == (0, "direct\n")
        await fast.files.write("/tmp/d", b"straight to the node")
        assert await a.files.read("/tmp/d") == b"straight to the node"
        assert (await fast.usage()).sandbox == a.id
        # What changes its lifetime stays with the gateway.
        with pytest.raises(Unauthenticated, match="does not allow close"):
            await fast.close()
        access = await (await c._ready()).direct(a.id, 60)
        node_url = access.url
        auth = {"authorization": f"Bearer {access.token}"}
        async with httpx.AsyncClient(base_url=node_url) as http:
            # Another sandbox on the same node, the node's own listing, its
            # metrics: none of it opens with this token.
            assert (await http.get(f"/v1/sandboxes/{b.id}", headers=auth)).status_code == 401
            assert (await http.get("/v1/sandboxes", headers=auth)).status_code == 401
            assert (await http.get("/metrics", headers=auth)).status_code == 401
            forged = access.token[:-2] + ("AA" if not access.token.endswith("AA") else "BB")
            bad = {"authorization": f"Bearer {forged}"}
            r2 = await http.get(f"/v1/sandboxes/{a.id}", headers=bad)
            assert r2.status_code == 401 and "signature" in r2.text
        short = await a.direct(ttl=1)
        await asyncio.sleep(1.2)
        with pytest.raises(Unauthenticated, match="expired"):
            await short.commands.run("true")
        with pytest.raises(InvalidArgument) as err:
            await a.direct(ttl=7200)
        assert err.value.details["field"] == "ttl"
        await a.close()
        await b.close()
        with pytest.raises(SandboxNotFound):
            await c.sandboxes.get("d0-" + "0" * 16)
    # Another project cannot get a path to this project's sandbox.
    other = cluster.project("dist-other")
    async with cluster.client(key) as c, cluster.client(other) as o:
        mine = await c.sandboxes.create(**SPEC)
        with pytest.raises(SandboxNotFound):
            await (await o._ready()).direct(mine.id, 60)
        await mine.close()
