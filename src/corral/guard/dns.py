"""The node's DNS resolver for sandboxes: the only DNS they can reach.

Every DNS packet a sandbox sends lands here (nftables redirects port 53).
A query for a name the sandbox's policy allows is answered (from the
node's static host map, else by the upstream resolver), and the IPv4
addresses in the answer are added to the sandbox's egress set for their
TTL: allowing a name opens exactly the addresses it resolves to. Any other
query is refused and counted, which also closes DNS tunnelling through the
resolver: data encoded in names of a domain nobody allowed goes nowhere.

An allowed name whose answer points into a private range the policy did
not open (or an always-denied one) is refused whole: DNS rebinding cannot
open the internal network through a name.

Runs in the node's leader agent; hostile packets are parsed defensively
and a sandbox's query rate is bounded, in the kernel and here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dnslib import QTYPE, RCODE, RR, A, DNSRecord

from corral.guard.policy import NetworkPolicy
from corral.log import get_logger

log = get_logger("corral.dns")
RATE = 50  # queries per second per sandbox that reach the parser


NAMES_KEPT = 32
DENIED_NAME = "dns_denied_name:"  # an audit key: the name after it, its count as value


def name_allowed(name: str, allowed: list[str]) -> bool:
    name = name.lower().rstrip(".")
    for pattern in allowed:
        if pattern.startswith("*."):
            if name.endswith(pattern[1:]) and name != pattern[2:]:
                return True
        elif name == pattern:
            return True
    return False


@dataclass
class _Bucket:
    tokens: float = RATE
    stamp: float = field(default_factory=time.monotonic)

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens = min(RATE, self.tokens + (now - self.stamp) * RATE)
        self.stamp = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class Resolver(asyncio.DatagramProtocol):
    """`index_of(ip)` gives a sandbox's network block from its address (no
    I/O); `lookup(index)` gives (sandbox id, policy) for a block; `learn`
    opens addresses; `forbidden(policy, address)` says an upstream answer
    must not be learned (rebinding); `count(sandbox_id, key, n)` adds to
    the audit, called only from `flush()`.

    Cost per packet is bounded before any work: the kernel drops a
    sandbox's queries past DNS_RATE a second (guard/network.py), and here a
    packet from no sandbox, or past the sandbox's own token bucket, is
    dropped before it is parsed. Refusals are tallied in memory and written
    to the store (and logged) once per flush, not once per packet."""

    def __init__(
        self,
        *,
        index_of: Callable[[str], int | None],
        lookup: Callable[[int], tuple[str, NetworkPolicy] | None],
        allowed_names: Callable[[NetworkPolicy], list[str]],
        learn: Callable[..., None],
        forbidden: Callable[[NetworkPolicy, str], bool],
        count: Callable[[str, str, int], None],
        hosts: dict[str, str],
        upstream: str,
    ) -> None:
        self.index_of = index_of
        self.lookup = lookup
        self.allowed_names = allowed_names
        self.learn = learn
        self.forbidden = forbidden
        self.count = count
        self.hosts = {k.lower().rstrip("."): v for k, v in hosts.items()}
        self.upstream = upstream
        self.transport: asyncio.DatagramTransport | None = None
        self.buckets: dict[int, _Bucket] = {}
        # (network block, audit key) -> refusals since the last flush.
        self.tally: dict[tuple[int, str], int] = {}
        # The names each sandbox was refused, for its audit (what a build
        # step or an agent tried to reach): the first NAMES_KEPT only, so a
        # sandbox asking for random names cannot grow the store.
        self.names: dict[str, set[str]] = {}

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        index = self.index_of(addr[0])
        if index is None:
            return  # not from a sandbox: no answer at all
        if not self.buckets.setdefault(index, _Bucket()).take():
            self._refuse(index, "dns_denied")  # past its rate: not even parsed
            return
        asyncio.get_running_loop().create_task(self._answer(data, addr, index))

    def _refuse(self, index: int, key: str) -> None:
        self.tally[(index, key)] = self.tally.get((index, key), 0) + 1

    def pending(self, index: int) -> dict[str, int]:
        return {key: n for (i, key), n in self.tally.items() if i == index}

    def flush(self) -> dict[str, dict[str, int]]:
        """Write the refusals tallied since the last flush; returns them by
        sandbox (for the log)."""
        tally, self.tally = self.tally, {}
        out: dict[str, dict[str, int]] = {}
        for (index, key), n in tally.items():
            who = self.lookup(index)
            if who is None:
                continue  # the sandbox has gone meanwhile
            self.count(who[0], key, n)
            out.setdefault(who[0], {})[key] = n
        return out

    def _send(self, reply: bytes, addr: tuple[str, int]) -> None:
        if self.transport is not None:
            self.transport.sendto(reply, addr)

    def _refused(self, query: DNSRecord, addr: tuple[str, int]) -> None:
        reply = query.reply()
        reply.header.rcode = RCODE.REFUSED
        self._send(reply.pack(), addr)

    async def _answer(self, data: bytes, addr: tuple[str, int], index: int) -> None:
        try:
            query = DNSRecord.parse(data)
            qname = str(query.q.qname).lower().rstrip(".")
            qtype = QTYPE[query.q.qtype]
        except Exception:
            self._refuse(index, "dns_denied")
            return  # not DNS: dropped without an answer
        who = self.lookup(index)
        if who is None:
            self._refused(query, addr)
            return
        sandbox_id, policy = who
        if not name_allowed(qname, self.allowed_names(policy)):
            self._refuse(index, "dns_denied")
            if sandbox_id not in self.names and len(self.names) >= 4096:
                del self.names[next(iter(self.names))]  # the oldest sandbox's: bounded
            kept = self.names.setdefault(sandbox_id, set())
            if qname in kept or len(kept) < NAMES_KEPT:
                kept.add(qname)
                self._refuse(index, DENIED_NAME + qname[:253])
            self._refused(query, addr)
            return
        if qname in self.hosts:
            reply = query.reply()
            if qtype in ("A", "ANY"):
                reply.add_answer(RR(qname, QTYPE.A, rdata=A(self.hosts[qname]), ttl=60))
                # The node's own map: trusted even where it points inside.
                self.learn(index, [self.hosts[qname]], 60, trusted=True)
            self._send(reply.pack(), addr)
            return
        answer = await self._forward(data)
        if answer is None:
            reply = query.reply()
            reply.header.rcode = RCODE.SERVFAIL
            self._send(reply.pack(), addr)
            return
        try:
            parsed = DNSRecord.parse(answer)
            addresses = [str(rr.rdata) for rr in parsed.rr if rr.rtype == QTYPE.A]
            ttl = min((rr.ttl for rr in parsed.rr if rr.rtype == QTYPE.A), default=60)
        except Exception:
            reply = query.reply()
            reply.header.rcode = RCODE.SERVFAIL
            self._send(reply.pack(), addr)
            return
        if any(self.forbidden(policy, a) for a in addresses):
            # An allowed name pointing inside (DNS rebinding): the answer
            # is dropped whole, nothing is learned.
            self._refuse(index, "dns_rebinding")
            self._refused(query, addr)
            return
        self.learn(index, addresses, ttl)
        self._send(answer, addr)

    async def _forward(self, data: bytes) -> bytes | None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bytes] = loop.create_future()

        class _Once(asyncio.DatagramProtocol):
            def datagram_received(self, d: bytes, _a: Any) -> None:
                if not fut.done():
                    fut.set_result(d)

        host, _, port = self.upstream.partition(":")
        transport, _ = await loop.create_datagram_endpoint(
            _Once, remote_addr=(host, int(port or 53))
        )
        try:
            transport.sendto(data)
            async with asyncio.timeout(3.0):
                return await fut
        except (TimeoutError, OSError):
            return None
        finally:
            transport.close()


def upstream_from_resolv_conf(path: str = "/etc/resolv.conf") -> str:
    try:
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] == "nameserver" and ":" not in parts[1]:
                    return parts[1]
    except OSError:
        pass
    return "1.1.1.1"
