"""Which addresses are the cluster's own, in one place.

Four parts judge addresses, and they must agree on what "inside" means:
the pull guard (a tenant's registry must resolve outside: `outside`), the
sandbox network (private ranges a policy must name to reach, and answers an
allowed name must not give: `PRIVATE`, `ALWAYS_DENIED`, `private`), cluster
up (the control plane's own hosts, denied to every sandbox: `host_networks`)
and the local-registry rule (plain HTTP only to loopback: `loopback_host`).

An IPv6 address may carry an IPv4 one that a gateway routes to (mapped,
6to4, NAT64's well-known prefix): it is judged by what it carries. The other
embeddings (Teredo, IPv4-compatible, SIIT, NAT64's local-use prefix) are
refused whole: nothing here has a reason to reach them.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# Never reachable from a sandbox, whatever its policy says: "this" network,
# loopback, link-local (the metadata service), multicast and reserved.
ALWAYS_DENIED = ["0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4"]
# Reachable from a sandbox only where its policy names a range inside them
# (an internal mirror): private, shared (carrier-grade NAT), benchmarking,
# and the IETF protocol-assignment block.
PRIVATE = ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "198.18.0.0/15",
           "192.0.0.0/24"]  # fmt: skip
_PRIVATE_NETS = [ipaddress.IPv4Network(c) for c in PRIVATE]
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_MAPPED = ipaddress.IPv6Network("::ffff:0:0/96")
_SIXTOFOUR = ipaddress.IPv6Network("2002::/16")
_REFUSED6 = [ipaddress.IPv6Network(n) for n in (
    "64:ff9b:1::/48", "2001::/32", "::/96", "::ffff:0:0:0/96", "2002::/16")]  # fmt: skip
_RESERVED4 = [ipaddress.IPv4Network(n) for n in ("192.0.0.0/24", "0.0.0.0/8")]
# Every label a number (decimal, octal, 0x hex): an address in disguise.
_NUMERIC = re.compile(r"(?:(?:0x[0-9a-f]*|[0-9]+)\.){0,3}(?:0x[0-9a-f]*|[0-9]+)")
_LOCAL_NAMES = (".localhost", ".local", ".internal", ".lan", ".home.arpa", ".cluster.local")


def carried(ip: Address) -> Address | None:
    """The address `ip` reaches: itself, the IPv4 address an IPv6 form
    carries (mapped, 6to4, NAT64), or None for an embedding refused whole."""
    if isinstance(ip, ipaddress.IPv4Address):
        return ip
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if any(ip in net for net in _REFUSED6):
        return None
    return ip


def carried_network(net: ipaddress.IPv6Network) -> ipaddress.IPv4Network | None:
    """The IPv4 network an IPv6 one holds in a form `carried` reads (mapped,
    NAT64's well-known prefix, 6to4), or None; None too for a whole form,
    which names the form (all of IPv4 is not what it denies)."""
    bits = int(net.network_address)
    for form, shift in ((_MAPPED, 0), (_NAT64, 0), (_SIXTOFOUR, 80)):
        if net.subnet_of(form) and net.prefixlen > form.prefixlen:
            inside = min(net.prefixlen - form.prefixlen, 32)
            base = (bits >> shift) & 0xFFFFFFFF
            return ipaddress.IPv4Network((base, inside), strict=False)
    return None


def outside(ip: Address, deny: Iterable[Network] = ()) -> bool:
    """An address outside the cluster's network: public (by what it
    carries), and in none of `deny`."""
    reached = carried(ip)
    if reached is None:
        return False
    if isinstance(reached, ipaddress.IPv4Address) and any(reached in n for n in _RESERVED4):
        return False
    if reached.is_multicast or (
        isinstance(reached, ipaddress.IPv6Address) and reached.is_site_local
    ):
        return False  # is_global counts both; neither is a registry's
    return reached.is_global and not any(a in net for net in deny for a in {ip, reached})


def private(ip: Address) -> bool:
    """Whether `ip` (by what it carries) lies in one of PRIVATE's ranges."""
    reached = carried(ip)
    return isinstance(reached, ipaddress.IPv4Address) and any(reached in n for n in _PRIVATE_NETS)


def private_network(cidr: str) -> bool:
    """Whether the IPv4 network (or address) `cidr` lies inside one of
    PRIVATE's ranges: a policy that names it opens a private range."""
    net = ipaddress.ip_network(cidr, strict=False)
    return isinstance(net, ipaddress.IPv4Network) and any(net.subnet_of(p) for p in _PRIVATE_NETS)


def host_name(host: str) -> str:
    """A registry host (HOST[:PORT], [V6]:PORT) as a resolver reads it: no
    port, no brackets, lower case, no trailing dot (LOCALHOST. is localhost)."""
    name = host[1:].split("]")[0] if host.startswith("[") else host.partition(":")[0]
    return name.lower().rstrip(".")


def host_port(host: str) -> tuple[str, int]:
    """A registry's HOST[:PORT] as (name, port): HTTPS's 443 where none."""
    name = host_name(host)
    tail = host.rsplit("]", 1)[-1] if host.startswith("[") else host
    _, colon, port = tail.rpartition(":")
    return name, int(port) if colon and port.isdigit() else 443


def inside_host(host: str) -> bool:
    """A host (HOST[:PORT], [V6]:PORT) that names the cluster's own network
    by itself: `inside_name` of its name."""
    return inside_name(host_name(host))


def inside_name(name: str) -> bool:
    """A bare host name (no port, no brackets, lower case) that names the
    cluster's own network by itself, with no resolver asked: a non-public
    address, a number the C resolver reads as one (127.1, 2130706433,
    0x7f.1), localhost or a local suffix."""
    try:
        return not outside(ipaddress.ip_address(name))
    except ValueError:
        return bool(_NUMERIC.fullmatch(name)) or name == "localhost" or name.endswith(_LOCAL_NAMES)


def loopback_host(host: str) -> bool:
    """A host (HOST[:PORT]) on this machine's loopback by its spelling:
    localhost or a loopback address (never a resolver's answer)."""
    name = host_name(host)
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_networks(name: str) -> list[str]:
    """Every address `name` resolves to here, as a one-address network
    (/32 or /128), loopback left out; none where it does not resolve."""
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    out = set()
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if not address.is_loopback and not (address.version == 6 and address.is_link_local):
            out.add(str(ipaddress.ip_network(address)))
    return sorted(out)
