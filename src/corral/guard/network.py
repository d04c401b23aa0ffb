"""Per-sandbox egress: a veth into the sandbox's own network namespace,
routed (no bridge: sandboxes share no L2), filtered by nftables.

Per node, one table `inet corral_<node>`:
  - prerouting: every DNS packet from a sandbox goes to the node's resolver
    (guard/dns.py), whatever server the sandbox asked;
  - input: from a sandbox, only that resolver port reaches the host (an
    own disk's DHCP is read before input, by a packet socket on its veth:
    guard/dhcp.py);
  - forward: into a sandbox, only replies; out of a sandbox, a per-sandbox
    chain chosen by interface (never by source address, which a sandbox
    cannot spoof anyway without CAP_NET_RAW/NET_ADMIN);
  - per sandbox: addresses always refused (metadata service, link-local,
    loopback, multicast, every sandbox address, configured control-plane
    ranges); then the private ranges it names in its CIDRs and the
    addresses of the node's own host map (an ecosystem mirror on the
    internal network); then every other private or shared range
    (RFC 1918, 100.64/10, benchmarking) is refused: a CIDR like 0.0.0.0/0
    does not open the internal network, only a CIDR inside a private range
    does; then its other CIDRs and the public addresses its allowed names
    resolved to (guard/dns.py drops private answers: no rebinding), on its
    allowed ports; everything else dropped and counted;
  - the resolver's port takes at most DNS_RATE queries a second from each
    sandbox, counted and dropped in the kernel past that, so a flood costs
    the node agent nothing;
  - postrouting: masquerade to the outside.

Sandboxes created without a policy have no veth at all: loopback only.
"""

from __future__ import annotations

import hashlib
import ipaddress
import subprocess
from dataclasses import dataclass
from pathlib import Path

from corral.addresses import (
    ALWAYS_DENIED,
    PRIVATE,
    carried,
    carried_network,
    private,
    private_network,
)
from corral.errors import InvalidArgument, Unavailable
from corral.guard.nft import Nft
from corral.guard.policy import NetworkPolicy
from corral.log import get_logger

log = get_logger("corral.network")

DNS_RATE = 100  # queries per second per sandbox, burst as many
# Addresses a sandbox's allowed names resolved to, kept in the kernel per
# sandbox and set (n, h), and taken from one answer. The sandbox chooses
# what it asks (an allowed wildcard, a name whose answers rotate), and each
# element is host kernel memory; a full set learns nothing more (the
# connection is refused and counted) until entries expire. Read at call time.
LEARNED_MAX = 16384
ANSWER_MAX = 32
LEARNED_TIMEOUT = "10m"


@dataclass(frozen=True)
class Attachment:
    index: int
    host_if: str
    host_ip: str
    sandbox_ip: str


def _sh(cmd: list[str], stdin: str | None = None) -> None:
    proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True)
    if proc.returncode != 0:
        raise Unavailable(f"network setup failed: {' '.join(cmd)}: {proc.stderr.strip()}")


class NodeNetwork:
    def __init__(
        self, node: str, pool: str, dns_port: int, deny: list[str], ecosystems: dict[str, list[str]]
    ) -> None:
        self.node = node
        self.pool = ipaddress.ip_network(pool)
        self.dns_port = dns_port
        # IPv4 only: a sandbox has no IPv6 route (its chain's last rule drops
        # every packet no earlier rule accepted, IPv6 included), and the
        # node's sets hold IPv4 addresses. An IPv6 entry that holds IPv4
        # ones (::ffff:10.0.0.5/128) denies those; the others serve the pull
        # guard (images/egress.py).
        nets = [ipaddress.ip_network(c, strict=False) for c in (*ALWAYS_DENIED, pool, *deny)]
        fours = [n if isinstance(n, ipaddress.IPv4Network) else carried_network(n) for n in nets]
        # Merged: an interval set refuses overlapping elements, and an
        # operator's 10.0.0.0/8 holds the pool (before, the table failed).
        self.deny = list(ipaddress.collapse_addresses(n for n in fours if n is not None))
        self.ecosystems = ecosystems
        self.table = f"corral_{node}"
        self.prefix = "cr" + hashlib.sha1(node.encode()).hexdigest()[:4]
        self._nft: Nft | None = None

    @property
    def nft(self) -> Nft:
        if self._nft is None:
            self._nft = Nft()
        return self._nft

    @property
    def capacity(self) -> int:
        return int(self.pool.num_addresses // 4)

    def check(self, policy: NetworkPolicy) -> None:
        unknown = sorted(set(policy.ecosystems) - set(self.ecosystems))
        if unknown:
            raise InvalidArgument(
                "network.ecosystems",
                f"must name ecosystems this node maps: {', '.join(sorted(self.ecosystems))}",
                unknown,
            )

    def addresses(self, index: int) -> tuple[str, str]:
        base = int(self.pool.network_address) + 4 * index
        return str(ipaddress.ip_address(base + 1)), str(ipaddress.ip_address(base + 2))

    def index_of(self, ip: str) -> int | None:
        addr = ipaddress.ip_address(ip)
        if addr not in self.pool:
            return None
        return (int(addr) - int(self.pool.network_address)) // 4

    def allowed_names(self, policy: NetworkPolicy) -> list[str]:
        names = list(policy.domains)
        for eco, on in policy.ecosystems.items():
            if on:
                names += self.ecosystems.get(eco, [])
        return names

    # ------------------------------------------------------------ node tables

    def ensure_base(self) -> None:
        """Create the node's table once (idempotent); turn on forwarding."""
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
        try:
            self.nft.run(f"list table inet {self.table}")
        except Unavailable:
            pass
        else:
            try:
                self.nft.run(f"list map inet {self.table} dnsin")
            except Unavailable:
                raise Unavailable(
                    f"nftables table inet {self.table} was made by an older Corral (it lacks the "
                    "per-sandbox DNS rate): close this node's networked sandboxes, or run "
                    f"`nft delete table inet {self.table}`"
                ) from None
            return
        t, p = self.table, self.prefix
        deny = ", ".join(str(n) for n in self.deny)
        ranges = ", ".join(PRIVATE)
        self.nft.run(f"""
        add table inet {t}
        add set inet {t} deny {{ type ipv4_addr; flags interval; elements = {{ {deny} }}; }}
        add set inet {t} private {{ type ipv4_addr; flags interval; elements = {{ {ranges} }}; }}
        add map inet {t} egress {{ type ifname : verdict; }}
        add map inet {t} dnsin {{ type ifname : verdict; }}
        add chain inet {t} prerouting {{ type nat hook prerouting priority dstnat; policy accept; }}
        add rule inet {t} prerouting iifname "{p}*" meta l4proto {{ udp, tcp }} th dport 53 \
            redirect to :{self.dns_port}
        add chain inet {t} postrouting {{ type nat hook postrouting priority srcnat; \
            policy accept; }}
        add rule inet {t} postrouting ip saddr {self.pool} oifname != "{p}*" masquerade
        add chain inet {t} input {{ type filter hook input priority filter; policy accept; }}
        add rule inet {t} input iifname "{p}*" udp dport {self.dns_port} iifname vmap @dnsin
        add rule inet {t} input iifname "{p}*" ct state established,related accept
        add rule inet {t} input iifname "{p}*" drop
        add chain inet {t} forward {{ type filter hook forward priority filter; policy accept; }}
        add rule inet {t} forward oifname "{p}*" ct state established,related accept
        add rule inet {t} forward oifname "{p}*" drop
        add rule inet {t} forward iifname "{p}*" iifname vmap @egress
        add rule inet {t} forward iifname "{p}*" drop
        """)
        log.info("network.table", table=t)

    def remove_base(self) -> None:
        """The node's table gone, at its last agent's exit: through the nft
        program, not libnftables in this process. libnftables has aborted
        the whole process here (SIGABRT inside nft_run_cmd_from_buffer, in
        three CI sessions; the cause is not established, and its message
        went with the process): in a child it fails only this, and says why."""
        try:
            done = subprocess.run(
                ["nft", "delete", "table", "inet", self.table],
                capture_output=True, text=True, timeout=30,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("network.table_remove_failed", table=self.table, error=str(exc))
            return
        if done.returncode != 0 and "No such file" not in done.stderr:
            log.warning(
                "network.table_remove_failed", table=self.table, code=done.returncode,
                error=done.stderr[-800:],
            )  # fmt: skip

    # ------------------------------------------------------------ sandboxes

    def host_if(self, index: int) -> str:
        return f"{self.prefix}{index}"

    def host_mac(self, index: int) -> str:
        """The host end's MAC, the same on every attach of one index: a VM
        resumed into a new QEMU (a new veth) keeps the neighbour entry it
        has for its gateway, which a random MAC would leave stale."""
        return "02:c0:" + ":".join(f"{b:02x}" for b in index.to_bytes(4, "big"))

    def attach(self, index: int, pid: int, tap: str | None = None) -> Attachment:
        """Give the sandbox whose init is `pid` an interface and a route
        (link), and its own chain, sets and counters, empty (apply fills
        them)."""
        self.ensure_base()
        att = self.link(index, pid, tap)
        t, i, host = self.table, index, att.host_if
        self.nft.run(
            "\n".join(
                [
                    f"add set inet {t} a{i} {{ type ipv4_addr; flags interval; }}",
                    f"add set inet {t} ap{i} {{ type ipv4_addr; flags interval; }}",
                    f"add set inet {t} n{i} {{ type ipv4_addr; flags timeout; "
                    f"size {LEARNED_MAX}; }}",
                    f"add set inet {t} h{i} {{ type ipv4_addr; flags timeout; "
                    f"size {LEARNED_MAX}; }}",
                    f"add set inet {t} p{i} {{ type inet_service; }}",
                    f"add counter inet {t} d{i}",
                    f"add counter inet {t} f{i}",
                    f"add chain inet {t} s{i}",
                    f"add rule inet {t} s{i} counter name d{i} drop",
                    f"add chain inet {t} q{i}",
                    f"add rule inet {t} q{i} limit rate over {DNS_RATE}/second burst {DNS_RATE} "
                    f"packets counter name f{i} drop",
                    f"add rule inet {t} q{i} accept",
                    f'add element inet {t} egress {{ "{host}" : jump s{i} }}',
                    f'add element inet {t} dnsin {{ "{host}" : jump q{i} }}',
                ]
            )
        )
        return att

    def link(self, index: int, pid: int, tap: str | None = None) -> Attachment:
        """The interface alone: a veth from the host into the namespace of
        `pid`, and its address and route there. With `tap` (a VM: `pid` is
        its QEMU, in a namespace of its own), the veth is bridged to the
        VM's tap instead, and the guest holds the sandbox's address: the
        host side, and so the policy, are the same."""
        host_ip, sbx_ip = self.addresses(index)
        host = self.host_if(index)
        peer = f"{host}p"
        _sh(
            ["ip", "-batch", "-"],
            stdin=(
                f"link add {host} address {self.host_mac(index)} type veth peer name {peer}\n"
                f"link set {peer} netns {pid}\n"
                f"addr add {host_ip}/30 dev {host}\n"
                f"link set {host} up\n"
            ),
        )
        for key in ("rp_filter", "accept_local"):
            path = Path(f"/proc/sys/net/ipv4/conf/{host}/{key}")
            if path.exists():
                path.write_text("1" if key == "rp_filter" else "0")
        if tap is None:
            inside = (
                # An address (and route) kept on loopback for a checkpoint
                # (hold_address) give way to the interface.
                "address flush dev lo scope global\n"
                f"link set {peer} name eth0\n"
                f"addr add {sbx_ip}/30 dev eth0\n"
                "link set eth0 up\n"
                f"route replace default via {host_ip}\n"
            )
        else:
            inside = (
                "link add br0 type bridge\n"
                f"link set {peer} master br0\n"
                f"link set {tap} master br0\n"
                f"link set {peer} up\n"
                f"link set {tap} up\n"
                "link set br0 up\n"
            )
        _sh(["nsenter", "-t", str(pid), "-n", "ip", "-batch", "-"], stdin=inside)
        return Attachment(index, host, host_ip, sbx_ip)

    def unlink(self, index: int) -> None:
        """The interface alone goes (a checkpoint cannot carry a veth whose
        peer is on the host); its chain, its sets with the names learned,
        and its counters stay for link() (idempotent)."""
        subprocess.run(["ip", "link", "del", self.host_if(index)], capture_output=True)

    def hold_address(self, index: int, pid: int) -> None:
        """Once its interface is gone (unlink), keep the sandbox's address,
        and a default route, on the loopback of the namespace of `pid` (a
        container's init about to be checkpointed): at restore, CRIU binds
        and connects each connection back in repair mode, which needs both.
        Nothing leaves by them (the namespace has no other interface); a
        copy's connections are aborted (node/network.py), then link()
        replaces them."""
        _, sbx_ip = self.addresses(index)
        _sh(["nsenter", "-t", str(pid), "-n", "ip", "-batch", "-"],
            stdin=f"address add {sbx_ip}/32 dev lo\nroute add default dev lo\n")  # fmt: skip

    def apply(self, index: int, policy: NetworkPolicy) -> None:
        """(Re)write the sandbox's chain and sets in one transaction. Names
        the sandbox resolved earlier are forgotten: a tighter policy takes
        effect at once, also on connections already open."""
        t, i = self.table, index
        opened = ", ".join(c for c in policy.cidrs if private_network(c))
        public = ", ".join(c for c in policy.cidrs if not private_network(c))
        ports = ", ".join(str(p) for p in policy.ports)
        match_port = f"th dport @p{i} " if policy.ports else ""
        cmds = [f"flush set inet {t} {s}{i}" for s in ("a", "ap", "n", "h", "p")]
        cmds.append(f"flush chain inet {t} s{i}")
        for name, elements in (("a", public), ("ap", opened), ("p", ports)):
            if elements:
                cmds.append(f"add element inet {t} {name}{i} {{ {elements} }}")
        tcp_udp = "meta l4proto { tcp, udp }"
        cmds += [
            f"add rule inet {t} s{i} ip daddr @deny counter name d{i} drop",
            f"add rule inet {t} s{i} {tcp_udp} ip daddr @ap{i} {match_port}accept",
            f"add rule inet {t} s{i} {tcp_udp} ip daddr @h{i} {match_port}accept",
            f"add rule inet {t} s{i} ip daddr @private counter name d{i} drop",
            f"add rule inet {t} s{i} {tcp_udp} ip daddr @a{i} {match_port}accept",
            f"add rule inet {t} s{i} {tcp_udp} ip daddr @n{i} {match_port}accept",
            f"add rule inet {t} s{i} counter name d{i} drop",
        ]
        self.nft.run("\n".join(cmds))

    def learn(self, index: int, addresses: list[str], ttl: int, *, trusted: bool = False) -> None:
        """Addresses an allowed name resolved to, for as long as its TTL.
        `trusted`: answered from the node's own host map, which may point
        into a private range (an internal mirror); upstream answers are
        public only (the resolver drops the rest)."""
        if not addresses:
            return
        timeout = max(30, min(ttl, 3600))
        elements = ", ".join(f"{a} timeout {timeout}s" for a in addresses[:ANSWER_MAX])
        name = f"{'h' if trusted else 'n'}{index}"
        try:
            self.nft.run(f"add element inet {self.table} {name} {{ {elements} }}")
        except Unavailable as exc:  # full (ENFILE): learned nothing of this answer
            log.warning("network.learn_refused", set=name, error=exc.message[:200])

    def inherit(self, source: int, index: int) -> int:
        """A fork's copy gets the addresses its source's allowed names
        resolved to, for what is left of their TTLs: the copy holds the
        source's memory, its DNS caches and resolved addresses among it,
        and would otherwise be refused them until it asked again. Returns
        how many; a source gone meanwhile gives none."""
        t = self.table
        adds = []
        for name in ("n", "h"):
            try:
                doc = self.nft.json(f"list set inet {t} {name}{source}")
            except Unavailable:
                return 0
            for item in doc.get("nftables", []):
                for e in item.get("set", {}).get("elem", []):
                    elem = e.get("elem", {}) if isinstance(e, dict) else {}
                    if isinstance(elem.get("val"), str) and int(elem.get("expires", 0)) > 0:
                        adds.append((name, elem["val"], int(elem["expires"])))
        for name in ("n", "h"):
            elements = ", ".join(f"{a} timeout {ttl}s" for n, a, ttl in adds if n == name)
            if elements:
                self.nft.run(f"add element inet {t} {name}{index} {{ {elements} }}")
        return len(adds)

    def reachable_private(self, policy: NetworkPolicy, address: str) -> bool:
        """Whether a private `address` in a DNS answer is one the policy
        itself opened (a CIDR inside a private range that holds it)."""
        addr = ipaddress.ip_address(address)
        return any(
            private_network(c) and addr in ipaddress.ip_network(c, strict=False)
            for c in policy.cidrs
        )

    def forbidden_answer(self, policy: NetworkPolicy, address: str) -> bool:
        """An upstream answer the sandbox must not learn: always-denied, or
        private and not opened by its policy (DNS rebinding), judged by the
        IPv4 address it carries; an IPv6 one that carries none is of no use
        to a sandbox (it has no IPv6 route)."""
        try:
            addr = ipaddress.ip_address(address)
        except ValueError:
            return True
        reached = carried(addr)
        if not isinstance(reached, ipaddress.IPv4Address) or any(reached in n for n in self.deny):
            return True
        return private(reached) and not self.reachable_private(policy, str(reached))

    def _counter(self, name: str) -> int:
        try:
            doc = self.nft.json(f"list counter inet {self.table} {name}")
        except Unavailable:
            return 0
        for item in doc.get("nftables", []):
            if "counter" in item:
                return int(item["counter"].get("packets", 0))
        return 0

    def denied(self, index: int) -> int:
        """Packets the sandbox sent that its policy refused."""
        return self._counter(f"d{index}")

    def dns_flooded(self, index: int) -> int:
        """DNS queries dropped past the sandbox's rate."""
        return self._counter(f"f{index}")

    def detach(self, index: int) -> None:
        """Remove everything of the sandbox (idempotent)."""
        t, i = self.table, index
        for cmd in (
            f'delete element inet {t} egress {{ "{self.host_if(i)}" }}',
            f'delete element inet {t} dnsin {{ "{self.host_if(i)}" }}',
            f"delete chain inet {t} s{i}",
            f"delete chain inet {t} q{i}",
            f"delete set inet {t} a{i}",
            f"delete set inet {t} ap{i}",
            f"delete set inet {t} n{i}",
            f"delete set inet {t} h{i}",
            f"delete set inet {t} p{i}",
            f"delete counter inet {t} d{i}",
            f"delete counter inet {t} f{i}",
        ):
            try:
                self.nft.run(cmd)
            except Unavailable:
                pass
        subprocess.run(["ip", "link", "del", self.host_if(i)], capture_output=True)
