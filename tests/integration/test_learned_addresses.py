"""What a sandbox's DNS answers teach the egress policy is held in the
host's kernel (an nftables set per sandbox): the sandbox chooses what it
asks, so the sets are bounded, per answer and in all."""

from __future__ import annotations

import ipaddress

import pytest

from corral.guard import network as guard
from corral.guard.policy import NetworkPolicy

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


async def test_a_node_that_denies_ipv6_networks_still_networks_its_sandboxes(
    fresh_node: Node,
) -> None:
    """network_deny may name IPv6 networks (cluster up lists a host's every
    address, for the pull guard). The node's sets are IPv4 and a sandbox has
    no IPv6 route: before, an IPv6 entry failed every networked create, and
    so did an operator's range that holds the pool (an interval set refuses
    overlaps). An answer is judged by the IPv4 address it
    carries."""
    pool = ipaddress.ip_network(fresh_node.config.network_pool)
    holds_pool = str(pool.supernet(new_prefix=pool.prefixlen - 4))  # an operator's wider range
    node = fresh_node.with_config(
        network_deny=["2001:db8::/32", "198.51.100.0/24", "::ffff:203.0.113.0/120", holds_pool]
    )
    async with node.client() as c:
        sbx = await c.sandboxes.create(image=IMAGE, network={"domains": ["example.com"]})
        net = node.agent.parts.networks.network
        policy = NetworkPolicy(domains=["example.com"])
        # The last: denied by an IPv6 entry that holds it.
        for answer in ("198.51.100.7", "::ffff:198.51.100.7", "64:ff9b::c633:6407", "10.1.2.3",
                       "::ffff:10.1.2.3", "2001:db8::1", "127.0.0.1", "203.0.113.9"):  # fmt: skip
            assert net.forbidden_answer(policy, answer), answer
        assert not net.forbidden_answer(policy, "93.184.216.34")
        opened = NetworkPolicy(cidrs=["10.1.0.0/16"])
        assert not net.forbidden_answer(opened, "::ffff:10.1.2.3")
        await sbx.close()
    assert fresh_node.leftovers() == {}
