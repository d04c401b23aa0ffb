"""A tiny simulated cell: eight simulated node agents (bench/sim/node.py)
heartbeating into a PostgreSQL of its own, and one real `corral serve
--gateway` in front. A burst through the gateway is placed, charged and
recorded exactly once; a node whose heartbeat says it has room but which
answers "full" is passed over; closing returns the quota. What
bench/cellsim.py measures at DSec's scale, checked here for correctness only
(no timing)."""

from __future__ import annotations

import asyncio
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from bench.sim.cell import NODE_KEY, SimCell

import corral
from corral.api.http import HttpService
from corral.api.models import CreateSandbox
from corral.errors import NodeFull, ResourceExhausted, Unauthenticated, Unavailable

pytestmark = [pytest.mark.slow, pytest.mark.requires_postgres]

NODES, PER_NODE, BURST = 8, 80, 400
FULL = "n003"  # refuses every create while its heartbeat advertises free slots
SPEC: dict[str, Any] = {"image": "debian-python:bookworm", "cpu": 0.5, "memory": "256MiB"}
# Concurrent charges of one project chain can deadlock in PostgreSQL (the
# chain's rows are locked in heap order, see docs/cell-simulation.md); the
# gateway answers those Unavailable(retry), which create_many retries under
# the item's key for `retry_for`: long enough here that they cannot fail it.
BURSTING: dict[str, Any] = {"concurrency": 8, "key": "burst", "retry_for": 120.0}


@pytest.fixture(scope="module")
def cell() -> Iterator[SimCell]:
    root = Path(tempfile.mkdtemp(prefix="cellsim-test-", dir="/tmp"))
    c = SimCell(root, nodes=NODES, per_node=PER_NODE, create_delay=0.002, full=(FULL,))
    try:
        c.start()
        yield c
    finally:
        c.stop()
        c.remove()


@pytest.fixture(scope="module")
def org_key(cell: SimCell) -> str:
    """The org holds at most BURST sandboxes; it is the cell's operator (it
    reads the gateway's metrics)."""
    return cell.project("org", max_sandboxes=BURST, operator=True)


@pytest.fixture(scope="module")
def key(cell: SimCell, org_key: str) -> str:
    """job < team < org."""
    cell.project("team", parent="org")
    return cell.project("job", parent="team")


def _gateway(cell: SimCell, key: str) -> corral.AsyncClient:
    return corral.AsyncClient(cell.replicas[0].url, api_key=key)


def _node(cell: SimCell, name: str, key: str = NODE_KEY) -> HttpService:
    return HttpService(f"http://127.0.0.1:{cell.sim_port}/{name}", api_key=key)


def _used(cell: SimCell) -> dict[str, int]:
    rows = cell.psql("SELECT name, used_sandboxes FROM projects ORDER BY name")
    return {name: int(n) for name, n in rows}


def _rows(cell: SimCell) -> dict[str, int]:
    return {s: int(n) for s, n in cell.psql("SELECT state, COUNT(*) FROM sandboxes GROUP BY state")}


async def _stats(cell: SimCell) -> dict[str, Any]:
    """Each simulated node's counts, as the simulator keeps them."""
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {NODE_KEY}"}) as http:
        doc: dict[str, Any] = (
            await http.get(f"http://127.0.0.1:{cell.sim_port}/_sim/stats")
        ).json()
    return doc


async def _metrics(cell: SimCell, key: str) -> str:
    async with httpx.AsyncClient(headers={"authorization": f"Bearer {key}"}) as http:
        return (await http.get(f"{cell.replicas[0].url}/metrics")).text


async def test_a_simulated_node_answers_like_a_node(cell: SimCell) -> None:
    req = CreateSandbox(image=SPEC["image"], idempotency_key="direct-1")
    ok, full, forged = _node(cell, "n000"), _node(cell, FULL), _node(cell, "n000", "nk-wrong")
    try:
        first = await ok.create(req)
        again = await ok.create(req)
        assert first.id == again.id and first.id.startswith("n000-")
        assert first.state == "running"
        assert [s.id for s in await ok.list()] == [first.id]
        with pytest.raises(NodeFull) as refused:
            await full.create(req)
        assert refused.value.details["node"] == FULL
        with pytest.raises(Unauthenticated):
            await forged.create(req)
        await ok.close(first.id)
        assert (await ok.get(first.id)).state == "closed"
        assert await ok.list() == []
    finally:
        for s in (ok, full, forged):
            await s.aclose()


async def test_a_burst_is_placed_charged_and_recorded_once(
    cell: SimCell, key: str, org_key: str
) -> None:
    async with _gateway(cell, key) as gw:
        made = await gw.sandboxes.create_many(SPEC, BURST, **BURSTING)
        refused = [r for r in made if not isinstance(r, corral.AsyncSandbox)]
        assert refused == []
        ids = [r.id for r in made if isinstance(r, corral.AsyncSandbox)]
        assert len(set(ids)) == BURST
        assert all(re.fullmatch(r"n\d{3}-[0-9a-f]{16}", i) for i in ids)

        # The store agrees: one ready row per sandbox, each charged at every level.
        assert _rows(cell).get("ready") == BURST
        assert _used(cell) == {"job": BURST, "org": BURST, "team": BURST}
        stored = dict(cell.psql("SELECT id, node FROM sandboxes WHERE state = 'ready'"))
        assert stored == {i: i.split("-")[0] for i in ids}

        # The full node was asked (its heartbeat said it had room), said
        # "full", and every create it refused went elsewhere.
        stats = await _stats(cell)
        assert stats[FULL]["calls"].get("full_slots", 0) > 0
        assert stats[FULL]["active"] == 0 and not any(i.startswith(FULL) for i in ids)
        metrics = await _metrics(cell, org_key)  # the operator's
        moved = re.search(r'corral_gateway_create_elsewhere_total\{reason="full"\} (\S+)', metrics)
        assert moved is not None and float(moved.group(1)) > 0

        # Spread: the better of two random choices keeps nodes even.
        loads = [stats[f"n{i:03d}"]["active"] for i in range(NODES) if f"n{i:03d}" != FULL]
        assert sum(loads) == BURST
        assert max(loads) <= 2 * (sum(loads) / len(loads))

        # The same keys again: the same sandboxes, nothing new made or charged.
        again = await gw.sandboxes.create_many(SPEC, BURST, **BURSTING)
        assert sorted(r.id for r in again if isinstance(r, corral.AsyncSandbox)) == sorted(ids)
        assert _used(cell)["org"] == BURST and _rows(cell).get("ready") == BURST

        # The org is at its limit: one more is refused cleanly, nothing charged.
        with pytest.raises(ResourceExhausted) as over:
            await gw.sandboxes.create(**SPEC)
        assert over.value.details.get("quota") is True
        assert over.value.details.get("project") == "org"
        assert _used(cell)["org"] == BURST
        assert sum(_rows(cell).values()) == BURST

        # Closing returns every charge, and the nodes' counts with it.
        gate = asyncio.Semaphore(8)

        async def close(s: corral.AsyncSandbox) -> None:
            async with gate:
                for _ in range(30):
                    try:
                        return await s.close()
                    except Unavailable as exc:  # a deadlock on the quota rows: retryable
                        assert exc.details.get("retry"), exc
                        await asyncio.sleep(0.2)
                raise AssertionError(f"{s.id} could not be closed")

        await asyncio.gather(*(close(s) for s in made if isinstance(s, corral.AsyncSandbox)))
    assert _used(cell) == {"job": 0, "org": 0, "team": 0}
    assert _rows(cell) == {"closed": BURST}
    assert all(n["active"] == 0 and n["held"] == 0 for n in (await _stats(cell)).values())
