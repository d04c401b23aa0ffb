"""What a sandbox's DNS answers teach the egress policy is held in the
host's kernel (an nftables set per sandbox): the sandbox chooses what it
asks, so the sets are bounded, per answer and in all."""

from __future__ import annotations

import pytest

from corral.guard import network as guard

from ..framework import IMAGE, Node

pytestmark = pytest.mark.integration


def _elements(node: Node, index: int) -> int:
    net = node.agent.parts.networks.network
    doc = net.nft.json(f"list set inet {net.table} n{index}")
    for item in doc.get("nftables", []):
        if "set" in item:
            return len(item["set"].get("elem", []))
    raise AssertionError(f"no set n{index}: {doc}")


async def test_learned_addresses_are_bounded_per_answer_and_per_sandbox(
    fresh_node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, an answer's every address was learned, and a set had no
    size: a name whose answers rotate grew the host's kernel memory for as
    long as the TTLs ran. A full set refuses more (the resolver goes on)."""
    monkeypatch.setattr(guard, "LEARNED_MAX", 64)
    async with fresh_node.client() as c:
        sbx = await c.sandboxes.create(image=IMAGE, network={"domains": ["example.com"]})
        networks = fresh_node.agent.parts.networks
        index = networks.index(sbx.id)
        assert index is not None
        net = networks.network
        net.learn(index, [f"198.51.100.{i}" for i in range(1, 101)], 600)
        assert _elements(fresh_node, index) == guard.ANSWER_MAX
        for k in range(10):
            net.learn(index, [f"203.0.{k}.{i}" for i in range(1, 33)], 600)
        assert _elements(fresh_node, index) == 64  # full: the rest refused, not raised
        await sbx.close()
    assert fresh_node.leftovers() == {}
