"""The node's DNS resolver for sandboxes: the only DNS they can reach.

Every DNS packet a sandbox sends lands here (nftables redirects port 53).
A query for a name the sandbox's policy allows is answered (from the
node's static host map, else by the upstream resolver), and the IPv4
addresses in the answer are added to the sandbox's egress set for their
TTL: allowing a name opens exactly the addresses it resolves to. Any other
query is refused and counted, which also closes DNS tunnelling through the
resolver: data encoded in names of a domain nobody allowed goes nowhere.

Runs in the node's leader agent; hostile packets are parsed defensively
and a sandbox's query rate is bounded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dnslib import QTYPE, RCODE, RR, A, DNSRecord

from corral.api.models import NetworkPolicy
from corral.log import get_logger

log = get_logger("corral.dns")
RATE = 50  # queries per second per sandbox


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
    """`lookup(ip)` gives (sandbox id, index, policy) for a sandbox address;
    `learn(index, addresses, ttl)` opens addresses; `denied(sandbox_id)`
    counts a refusal."""

    def __init__(
        self,
        *,
        lookup: Callable[[str], tuple[str, int, NetworkPolicy] | None],
        allowed_names: Callable[[NetworkPolicy], list[str]],
        learn: Callable[[int, list[str], int], None],
        denied: Callable[[str], None],
        hosts: dict[str, str],
        upstream: str,
    ) -> None:
        self.lookup = lookup
        self.allowed_names = allowed_names
        self.learn = learn
        self.denied = denied
        self.hosts = {k.lower().rstrip("."): v for k, v in hosts.items()}
        self.upstream = upstream
        self.transport: asyncio.DatagramTransport | None = None
        self.buckets: dict[str, _Bucket] = {}

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        asyncio.get_running_loop().create_task(self._answer(data, addr))

    def _send(self, reply: bytes, addr: tuple[str, int]) -> None:
        if self.transport is not None:
            self.transport.sendto(reply, addr)

    async def _answer(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            query = DNSRecord.parse(data)
            qname = str(query.q.qname).lower().rstrip(".")
            qtype = QTYPE[query.q.qtype]
        except Exception:
            return  # not DNS: dropped without an answer
        who = self.lookup(addr[0])
        reply = query.reply()
        if who is None:
            reply.header.rcode = RCODE.REFUSED
            self._send(reply.pack(), addr)
            return
        sandbox_id, index, policy = who
        bucket = self.buckets.setdefault(sandbox_id, _Bucket())
        if not bucket.take() or not name_allowed(qname, self.allowed_names(policy)):
            self.denied(sandbox_id)
            log.info("dns.refused", sandbox=sandbox_id, name=qname[:253], type=qtype)
            reply.header.rcode = RCODE.REFUSED
            self._send(reply.pack(), addr)
            return
        if qname in self.hosts:
            if qtype in ("A", "ANY"):
                reply.add_answer(RR(qname, QTYPE.A, rdata=A(self.hosts[qname]), ttl=60))
                self.learn(index, [self.hosts[qname]], 60)
            self._send(reply.pack(), addr)
            return
        answer = await self._forward(data)
        if answer is None:
            reply.header.rcode = RCODE.SERVFAIL
            self._send(reply.pack(), addr)
            return
        try:
            parsed = DNSRecord.parse(answer)
            addresses = [str(rr.rdata) for rr in parsed.rr if rr.rtype == QTYPE.A]
            ttl = min((rr.ttl for rr in parsed.rr if rr.rtype == QTYPE.A), default=60)
            self.learn(index, addresses, ttl)
        except Exception:
            reply.header.rcode = RCODE.SERVFAIL
            self._send(reply.pack(), addr)
            return
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
            return await asyncio.wait_for(fut, 3.0)
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
