"""One notion of the cluster's own addresses (corral/addresses.py), shared by
the pull guard, the sandbox network, cluster up and the local-registry rule."""

from __future__ import annotations

import ipaddress

import pytest

from corral.addresses import (
    carried,
    carried_network,
    host_networks,
    host_port,
    inside_host,
    loopback_host,
    outside,
    private,
    private_network,
)
from corral.guard.network import NodeNetwork

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("host", "split", "inside"),
    [("ghcr.io", ("ghcr.io", 443), False), ("reg.example:5000", ("reg.example", 5000), False),
     ("[::1]:5000", ("::1", 5000), True), ("0x7f.1", ("0x7f.1", 443), True),
     ("2130706433", ("2130706433", 443), True), ("a.cluster.local", ("a.cluster.local", 443), True),
     ("LOCALHOST.:80", ("localhost", 80), True), ("[64:ff9b::a00:5]", ("64:ff9b::a00:5", 443), True),
     ("[2606:4700::1111]:8443", ("2606:4700::1111", 8443), False)],
)  # fmt: skip
def test_registry_hosts_as_a_resolver_reads_them(
    host: str, split: tuple[str, int], inside: bool
) -> None:
    assert host_port(host) == split and inside_host(host) is inside


@pytest.mark.parametrize(
    ("text", "reached"),
    [("10.0.0.5", "10.0.0.5"), ("::ffff:10.0.0.5", "10.0.0.5"), ("2002:7f00:1::", "127.0.0.1"),
     ("64:ff9b::a9fe:a9fe", "169.254.169.254"), ("2606:4700::1111", "2606:4700::1111"),
     ("64:ff9b:1::1", None), ("2001:0:4136:e378::1", None), ("::127.0.0.1", None),
     ("::ffff:0:a00:5", None)],
)  # fmt: skip
def test_an_ipv6_form_is_judged_by_the_address_it_carries(text: str, reached: str | None) -> None:
    got = carried(ipaddress.ip_address(text))
    assert (None if got is None else str(got)) == reached


def test_an_address_that_carries_an_inside_one_is_inside() -> None:
    for text in ("64:ff9b::a00:5", "64:ff9b::a9fe:a9fe", "2002:7f00:1::", "::ffff:0:a00:5",
                 "::127.0.0.1", "64:ff9b:1::1", "2001:0:4136:e378::1", "192.0.0.8", "0.1.2.3",
                 "100.64.0.1", "fd00::1", "fe80::1"):  # fmt: skip
        assert not outside(ipaddress.ip_address(text)), text
    for text in ("64:ff9b::5db8:d822", "2002:5db8:d822::1", "2606:4700::1111", "93.184.216.34"):
        assert outside(ipaddress.ip_address(text)), text


def test_a_denied_network_catches_the_address_and_what_it_carries() -> None:
    deny = [ipaddress.ip_network("93.184.216.0/24"), ipaddress.ip_network("2606:4700::/32")]
    for text in ("93.184.216.34", "::ffff:93.184.216.34", "64:ff9b::5db8:d822", "2606:4700::1"):
        assert not outside(ipaddress.ip_address(text), deny), text
    assert outside(ipaddress.ip_address("93.184.217.1"), deny)


def test_private_ranges_are_seen_through_ipv6_forms() -> None:
    for text in (
        "10.1.2.3",
        "::ffff:192.168.1.1",
        "64:ff9b::a00:5",
        "2002:c0a8:101::",
        "100.64.1.1",
    ):
        assert private(ipaddress.ip_address(text)), text
    for text in ("93.184.216.34", "127.0.0.1", "2606:4700::1111", "64:ff9b:1::a00:5"):
        assert not private(ipaddress.ip_address(text)), text
    assert private_network("10.2.0.0/16") and not private_network("10.0.0.0/7")
    assert not private_network("fd00::/8")  # the sandbox network is IPv4 only


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("localhost:5000", True), ("127.0.0.1:5000", True), ("127.9.9.9", True), ("[::1]:5000", True),
     ("LocalHost", True), ("127.example.com", False), ("registry:5000", False),
     ("[::2]:5000", False), ("10.0.0.1:5000", False)],
)  # fmt: skip
def test_a_local_registry_is_loopback_by_its_spelling(host: str, loopback: bool) -> None:
    assert loopback_host(host) is loopback


def test_a_hosts_networks_are_every_address_it_has_without_loopback() -> None:
    assert host_networks("192.0.2.7") == ["192.0.2.7/32"]
    assert host_networks("2001:db8::7") == ["2001:db8::7/128"]
    assert host_networks("127.0.0.1") == [] and host_networks("::1") == []
    assert host_networks("no-such-host.invalid") == []


@pytest.mark.parametrize(
    ("net", "held"),
    [("::ffff:10.0.0.5/128", "10.0.0.5/32"), ("::ffff:10.0.0.0/104", "10.0.0.0/8"),
     ("64:ff9b::a00:5/128", "10.0.0.5/32"), ("2002:a00:5::/48", "10.0.0.5/32"),
     ("2002:a00::/32", "10.0.0.0/16"), ("2001:db8::/32", None), ("fd00::/8", None)],
)  # fmt: skip
def test_an_ipv6_network_may_hold_ipv4_ones(net: str, held: str | None) -> None:
    got = carried_network(ipaddress.IPv6Network(net))
    assert (None if got is None else str(got)) == held


def test_multicast_and_site_local_are_not_outside() -> None:
    for text in ("224.0.0.1", "239.1.2.3", "ff02::1", "ff0e::1", "fec0::1"):
        assert not outside(ipaddress.ip_address(text)), text


def test_a_whole_form_names_the_form_not_all_of_ipv4() -> None:
    for net in ("::ffff:0:0/96", "64:ff9b::/96", "2002::/16", "::/0"):
        assert carried_network(ipaddress.IPv6Network(net)) is None, net


def test_a_nodes_deny_set_is_ipv4_and_without_overlaps() -> None:
    """An interval set refuses overlapping elements: before, an operator's
    10.0.0.0/8 (which holds the sandbox pool) failed the node's table, and
    so every networked create."""
    net = NodeNetwork(
        "n0", "10.210.0.0/16", 10253,
        ["10.0.0.0/8", "::ffff:203.0.113.0/120", "2002::/16", "2001:db8::/32", "127.0.0.1"],
        {},
    )  # fmt: skip
    assert [str(n) for n in net.deny] == [
        "0.0.0.0/8", "10.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "203.0.113.0/24",
        "224.0.0.0/3",
    ]  # fmt: skip
