"""Cloud bursting between two clusters on this machine (docs/bursting.md):
a home cluster of one small node whose gateway spills to a second
cluster's gateway once its node is nearly full. Every sandbox stays
reachable through the home gateway, quotas are charged at home, the cap
per target holds, and closing returns every charge."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import corral
from corral.control.burst import parse_targets
from corral.errors import InvalidArgument, ResourceExhausted

from ..framework import IMAGE, Cluster, free_port

pytestmark = [pytest.mark.slow, pytest.mark.requires_postgres]
SPEC: dict[str, Any] = {"image": IMAGE, "memory": "256MiB", "cpu": 0.25}
SLOTS, CAP = 3, 3


@pytest.fixture(scope="module")
def clusters(data_root: Path) -> Iterator[tuple[Cluster, Cluster, str]]:
    away = Cluster(data_root / "away", nodes=1, prefix="w", net_offset=12)
    home: Cluster | None = None
    try:
        away.start()
        burst_key = away.project("burst-account")
        targets = data_root / "burst.json"
        targets.write_text(
            json.dumps(
                [
                    # Unreachable and wrongly keyed targets come first: they
                    # are tried, named in errors, and cost nothing.
                    {"name": "dead", "url": f"http://127.0.0.1:{free_port()}", "api_key": "x"},
                    {"name": "wrongkey", "url": away.gateway.url, "api_key": "nope"},  # type: ignore[union-attr]
                    {"name": "away", "url": away.gateway.url, "api_key": burst_key, "cap": CAP},  # type: ignore[union-attr]
                ]
            )
        )
        home = Cluster(
            data_root / "home",
            nodes=1,
            prefix="h",
            net_offset=13,
            node_config={"max_sandboxes": SLOTS},
            gateway_args=["--burst-targets", str(targets), "--burst-threshold", "0.8"],
        )
        home.start()
        yield home, away, burst_key
    finally:
        if home is not None:
            home.stop()
        away.stop()
    for c in (home, away):
        assert c is not None
        assert {n.name: n.leftovers() for n in c.nodes} == {n.name: {} for n in c.nodes}
        shutil.rmtree(c.root, ignore_errors=True)


async def test_a_burst_spills_to_the_other_cluster_and_stays_reachable_through_home(
    clusters: tuple[Cluster, Cluster, str],
) -> None:
    home, away, _ = clusters
    key = home.project("job")
    async with home.client(key) as c:
        # One at a time, so each sees the last one's heartbeat (placement
        # reads capacity from heartbeats).
        sbxs: list[corral.AsyncSandbox] = []
        for _ in range(SLOTS + CAP - 1):
            sbxs.append(await c.sandboxes.create(**SPEC, labels={"job": "7"}))
            await asyncio.sleep(1.1)
        where = [s.id.split("-")[0] for s in sbxs]
        # The home node until 80% of its slots are in use, then the target.
        assert where.count("h0") == 3 and where.count("away") == CAP - 1, where
        for s in sbxs:
            r = await s.commands.run("hostname >/dev/null; echo $((6 * 7))")
            assert (r.exit_code, r.stdout) == (0, "42\n"), s.id
            await s.files.write("/tmp/f", s.id.encode())
            assert await s.files.read("/tmp/f") == s.id.encode()
        listed = sorted(s.id for s in await c.sandboxes.list(labels={"job": "7"}))
        assert listed == sorted(s.id for s in sbxs)
        # Charged once, at home, for all of them; the target charges its
        # own project for those it runs.
        assert home.used("job")[0] == len(sbxs)
        assert away.used("burst-account")[0] == CAP - 1
        # The cap: one more fits on the target (a retry with the same
        # idempotency key finds that one), the next finds no room.
        sbxs.append(await c.sandboxes.create(**SPEC, idempotency_key="same"))
        assert sbxs[-1].id.startswith("away-")
        assert (await c.sandboxes.create(**SPEC, idempotency_key="same")).id == sbxs[-1].id
        with pytest.raises(ResourceExhausted) as err:
            await c.sandboxes.create(**SPEC)
        msg = err.value.message
        assert "at its cap of 3" in msg, msg
        assert "burst target dead is unreachable" in msg, msg
        assert "burst target wrongkey refused its API key" in msg, msg
        assert home.used("job")[0] == len(sbxs)  # the refused one charged nothing
        await asyncio.gather(*(s.close() for s in sbxs))
        # A closed burst sandbox answers as closed, through home.
        with pytest.raises(corral.CorralError):
            await sbxs[-1].commands.run("true")
    assert home.used("job") == (0, 0.0, 0)
    assert away.used("burst-account") == (0, 0.0, 0)
    async with away.node_client(away.nodes[0]) as n:
        assert [s.id for s in await n.sandboxes.list() if "corral.key" in s.info.labels] == []


@pytest.mark.parametrize(
    ("docs", "field"),
    [
        ({"name": "x"}, "burst"),
        ([{"name": "Bad!", "url": "http://a", "api_key": "k"}], "burst[0].name"),
        ([{"name": "a", "url": "ftp://a", "api_key": "k"}], "burst[0].url"),
        ([{"name": "a", "url": "http://a", "api_key": ""}], "burst[0].api_key"),
        ([{"name": "a", "url": "http://a", "api_key": "k", "cap": 0}], "burst[0].cap"),
        ([{"name": "a", "url": "http://a", "api_key": "k", "cap": True}], "burst[0].cap"),
        ([{"name": "a", "url": "http://a", "api_key": "k", "colour": 1}], "burst[0].colour"),
        (
            [{"name": "a", "url": "http://a", "api_key": "k"}] * 2,
            "burst[1].name",
        ),
    ],
)
def test_bad_burst_targets_are_refused_naming_the_field(docs: Any, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        parse_targets(docs)
    assert err.value.details["field"] == field
