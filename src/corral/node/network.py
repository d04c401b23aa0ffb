"""Sandboxes on the network: giving one its interface and policy, taking
them away, the node's DNS resolver that only answers what a policy
allows, and DHCP for guests with no agent to be told their address (the
plumbing itself is guard/network.py, guard/dhcp.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from corral.api.models import NetworkPolicy
from corral.config import NodeConfig
from corral.errors import CorralError, InvalidArgument, SandboxFailed
from corral.execd.client import ExecdClient
from corral.guard.dhcp import Lease, Responder
from corral.guard.dns import DENIED_NAME, Resolver, upstream_from_resolv_conf
from corral.guard.network import NodeNetwork
from corral.host import spawn
from corral.host.platform import BUSYBOX, MOUNT_POINT
from corral.log import get_logger
from corral.node.store import SandboxRecord, Store

log = get_logger("corral.node")

GUEST_TIMEOUT = 30.0  # seconds for a VM copy's guest to take its address
GUEST_NETMOVE = f"{MOUNT_POINT}/bin/corral-netmove"  # in a VM guest's platform only
# corral-netmove walks one namespace's sockets: well under a second; a bound
# so that a stuck one fails its copy's create, not holds it.
NETMOVE_TIMEOUT = 30.0


class SandboxNetworks:
    def __init__(
        self,
        config: NodeConfig,
        store: Store,
        network: NodeNetwork,
        execd: Callable[[str], ExecdClient],
        netmove: Path,
    ) -> None:
        self.config = config
        self.netmove = netmove
        self.store = store
        self.network = network
        self._execd = execd
        self._resolver: asyncio.DatagramTransport | None = None
        self._protocol: Resolver | None = None
        self._policies: dict[int, tuple[str, NetworkPolicy]] = {}  # index -> (json, parsed)
        self._dhcp: dict[str, Responder] = {}  # sandbox id -> its guest's DHCP server

    def guest_addresses(self, index: int) -> tuple[str, str]:
        """(the sandbox's address, its gateway) for network block `index`."""
        host_ip, guest_ip = self.network.addresses(index)
        return guest_ip, host_ip

    async def connect(
        self,
        sandbox_id: str,
        pid: int,
        index: int,
        policy: NetworkPolicy,
        tap: str | None = None,
        *,
        agentless: bool = False,
        moved: bool = False,
        names_from: int | None = None,
    ) -> None:
        """Give a running sandbox its interface and policy, and point its
        resolver at the node's (the only DNS it can reach anyway). A VM's
        `pid` is its QEMU, and its veth is bridged to the VM's `tap`.
        `agentless`: a guest no agent configures (a user's own disk) asks
        for its address, gateway and resolver by DHCP, answered here.
        `moved`: the sandbox was loaded from another's saved state (a
        fork's copy, a restore on another node): it still holds that
        one's address and connections, which are not its own
        (docs/network-copies.md). `names_from`: the network block whose
        learned names it inherits (a fork's source on this node)."""
        if moved and tap is None:
            # Before its interface exists: the resets never leave.
            await self._abort_outside(sandbox_id, ["--netns-of", str(pid)])
        att = await asyncio.to_thread(self.network.attach, index, pid, tap)
        await asyncio.to_thread(self.network.apply, index, policy)
        if names_from is not None:
            n = await asyncio.to_thread(self.network.inherit, names_from, index)
            log.info("network.names_inherited", sandbox=sandbox_id, addresses=n)
        if agentless:
            self.serve_dhcp(sandbox_id, index)
            return
        client = self._execd(sandbox_id)
        if moved and tap is not None:
            await self._readdress_guest(sandbox_id, client, att.sandbox_ip, att.host_ip)
        try:
            await client.remove("root", "/etc/resolv.conf", recursive=False)
        except CorralError:
            pass
        await client.write(
            "root",
            "/etc/resolv.conf",
            f"nameserver {att.host_ip}\n".encode(),
            max_bytes=4096,
            mkdirs=True,
        )

    async def _abort_outside(self, sandbox_id: str, args: list[str]) -> None:
        """A container copy's connections to the outside, aborted from the
        host in its network namespace (corral-netmove)."""
        try:
            done = await spawn.run([str(self.netmove), *args], stdout=True, timeout=NETMOVE_TIMEOUT)
        except TimeoutError:
            raise SandboxFailed(
                f"sandbox {sandbox_id}: corral-netmove did not end its copied connections "
                f"within {NETMOVE_TIMEOUT:g} s",
                sandbox=sandbox_id,
            ) from None
        if done.code != 0:
            raise SandboxFailed(
                f"sandbox {sandbox_id}: its copied connections could not be ended: "
                f"{done.stderr.decode(errors='replace').strip()}",
                sandbox=sandbox_id,
            )
        self._log_aborted(sandbox_id, done.stdout)

    def _log_aborted(self, sandbox_id: str, out: bytes) -> None:
        aborted, _, kept = out.decode(errors="replace").strip().partition(" ")
        log.info("network.moved", sandbox=sandbox_id, aborted=aborted, loopback_kept=kept)

    async def _readdress_guest(
        self, sandbox_id: str, client: ExecdClient, address: str, gateway: str
    ) -> None:
        """A VM copy's guest holds its source's address: its NIC is taken
        down (no route out, so the resets of its copied connections never
        leave), those connections are aborted, and it comes up with this
        sandbox's address and gateway (its neighbour entries went with the
        link)."""
        bb = BUSYBOX
        script = (
            f"{bb} ip link set eth0 down && {bb} ip addr flush dev eth0 && {GUEST_NETMOVE} && "
            f"{bb} ip addr add {address}/30 dev eth0 && {bb} ip link set eth0 up && "
            f"{bb} ip route replace default via {gateway}"
        )
        code, out, err = await client.run(
            [bb, "sh", "-c", script], user="root", timeout=GUEST_TIMEOUT
        )
        if code != 0:
            raise SandboxFailed(
                f"sandbox {sandbox_id}: its guest could not take its address {address}: "
                f"{err.decode(errors='replace').strip() or f'exit {code}'}",
                sandbox=sandbox_id,
            )
        self._log_aborted(sandbox_id, out)

    def serve_dhcp(self, sandbox_id: str, index: int | None = None) -> None:
        """Answer the guest's DHCP on its veth's host end, from now until
        unplug or disconnect, or its veth goes (again after a resume, and
        by the leader once the agent that served it has died:
        housekeeping). Without an index, the sandbox's own; a sandbox
        whose veth is gone meanwhile is left alone."""
        if index is None:
            row = self.store.net_get(sandbox_id)
            if row is None:
                return
            index = row[0]
        self._stop_dhcp(sandbox_id)
        host_ip, guest_ip = self.network.addresses(index)
        try:
            responder = Responder(
                sandbox_id, self.network.host_if(index), Lease(guest_ip, host_ip),
                self.network.host_mac(index), on_gone=self._dhcp_gone,
            )  # fmt: skip
        except OSError as exc:  # no such interface: closed or suspended meanwhile
            log.warning("dhcp.not_served", sandbox=sandbox_id, error=str(exc))
            return
        responder.start()
        self._dhcp[sandbox_id] = responder
        log.info("dhcp.serving", sandbox=sandbox_id, interface=responder.ifname)

    def serves_dhcp(self, sandbox_id: str) -> bool:
        return sandbox_id in self._dhcp

    def _dhcp_gone(self, responder: Responder) -> None:
        if self._dhcp.get(responder.sandbox_id) is responder:
            self._stop_dhcp(responder.sandbox_id)

    def _stop_dhcp(self, sandbox_id: str) -> None:
        responder = self._dhcp.pop(sandbox_id, None)
        if responder is not None:
            if responder.dropped:
                self.store.count(sandbox_id, "dhcp_flooded", responder.dropped)
            responder.close()

    async def reconnect(
        self, sandbox_id: str, pid: int, tap: str | None, *, agentless: bool = False
    ) -> None:
        """After a resume, or a fork's save: the process has a new
        namespace (a VM a new tap), and the sandbox's veth died with the
        old one or was unplugged. Same address; the policy, the names it
        learned and its counters were kept (unplug)."""
        row = self.store.net_get(sandbox_id)
        if row is None:
            return
        self._stop_dhcp(sandbox_id)
        await asyncio.to_thread(self.network.unlink, row[0])
        await asyncio.to_thread(self.network.link, row[0], pid, tap)
        if agentless:
            self.serve_dhcp(sandbox_id, row[0])

    async def unplug(self, sandbox_id: str, pid: int) -> None:
        """Take a container's interface away before a checkpoint (it cannot
        carry a veth whose peer is on the host), keeping its policy,
        learned names and counters for reconnect(), and its address on its
        loopback for the checkpoint's connections (guard/network.py
        hold_address)."""
        self._stop_dhcp(sandbox_id)
        row = self.store.net_get(sandbox_id)
        if row is not None:
            await asyncio.to_thread(self.network.unlink, row[0])
            await asyncio.to_thread(self.network.hold_address, row[0], pid)

    def index(self, sandbox_id: str) -> int | None:
        row = self.store.net_get(sandbox_id)
        return None if row is None else row[0]

    def has_network(self, sandbox_id: str) -> bool:
        return self.store.net_get(sandbox_id) is not None

    def disconnect(self, sandbox_id: str) -> None:
        """Release a sandbox's network (the `net` resource); idempotent."""
        self._stop_dhcp(sandbox_id)
        db = self.store
        row = db.net_get(sandbox_id)
        if row is None:
            return
        for key, n in (("egress_denied", self.network.denied(row[0])),
                       ("dns_flooded", self.network.dns_flooded(row[0]))):  # fmt: skip
            if n:
                db.count(sandbox_id, key, n)
        self.network.detach(row[0])
        db.net_free(sandbox_id)

    async def update(self, rec: SandboxRecord, policy: NetworkPolicy, tap: str | None) -> None:
        """Change where a running sandbox may connect (loose while its
        environment is set up, tight while the task is solved). `tap`: its
        runtime's net_tap (a VM's NIC exists from boot or never)."""
        self.network.check(policy)
        db = self.store
        row = db.net_get(rec.id)
        if row is None and tap is not None:
            raise InvalidArgument(
                "network",
                "a VM created without network cannot get one later (its NIC exists from boot): "
                "create it with a policy, even an empty one",
                "policy",
            )
        if row is None:  # created without network: give it an interface now
            with db.transaction():
                db.add_resource(rec.id, "net", rec.id)
                index = db.net_allocate(rec.id, policy.model_dump_json(), self.network.capacity)
            assert rec.init_pid is not None
            await self.connect(rec.id, rec.init_pid, index, policy)
        else:
            await asyncio.to_thread(self.network.apply, row[0], policy)
            db.net_set_policy(rec.id, policy.model_dump_json())
        log.info(
            "network.updated",
            sandbox=rec.id,
            domains=len(policy.domains),
            cidrs=len(policy.cidrs),
            ecosystems=sorted(k for k, v in policy.ecosystems.items() if v),
        )

    def _policy_of(self, index: int) -> tuple[str, NetworkPolicy] | None:
        if self.store.closed:
            return None
        row = self.store.net_by_index(index)
        if row is None:
            return None
        cached = self._policies.get(index)
        if cached is None or cached[0] != row[1]:  # parsed again only when it changed
            cached = self._policies[index] = (row[1], NetworkPolicy.model_validate_json(row[1]))
        return row[0], cached[1]

    def _count(self, sandbox_id: str, key: str, n: int) -> None:
        self.store.count(sandbox_id, key, n)

    def pending(self, sandbox_id: str) -> dict[str, int]:
        """What the resolver refused this sandbox since its last flush (the
        audit adds it, so a refusal shows at once in this process)."""
        row = self.store.net_get(sandbox_id)
        if self._protocol is None or row is None:
            return {}
        return self._protocol.pending(row[0])

    def flush_resolver(self) -> None:
        """Write what the resolver refused since the last flush (each tick)."""
        if self._protocol is None or self.store.closed:
            return
        for sandbox_id, counts in self._protocol.flush().items():
            names = sorted(k[len(DENIED_NAME) :] for k in counts if k.startswith(DENIED_NAME))
            counts = {k: n for k, n in counts.items() if not k.startswith(DENIED_NAME)}
            log.info("dns.refused", sandbox=sandbox_id, names=names, **counts)

    async def start_resolver(self) -> None:
        """The node's DNS for sandboxes (run by the leader agent)."""
        if self._resolver is not None:
            return
        loop = asyncio.get_running_loop()
        protocol = Resolver(
            index_of=self.network.index_of,
            lookup=self._policy_of,
            allowed_names=self.network.allowed_names,
            learn=self.network.learn,
            forbidden=self.network.forbidden_answer,
            count=self._count,
            hosts=self.config.dns_hosts,
            upstream=self.config.dns_upstream or upstream_from_resolv_conf(),
        )
        try:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: protocol, local_addr=("0.0.0.0", self.config.dns_port)
            )
        except OSError as exc:
            log.error("dns.bind_failed", port=self.config.dns_port, error=str(exc))
            return
        self._resolver, self._protocol = transport, protocol
        log.info("dns.serving", port=self.config.dns_port)

    def stop_resolver(self) -> None:
        self.flush_resolver()
        if self._resolver is not None:
            self._resolver.close()
            self._resolver = self._protocol = None
