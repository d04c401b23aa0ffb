"""DHCP for a guest with no Corral agent (a user's own disk, docs/own-disk.md).

Corral's own guests are told their address on the kernel command line; an
OS from a user's disk asks for one the way it would on any network. The
node answers on the host end of the sandbox's veth, through a packet socket
(AF_PACKET) with a kernel filter that lets only IPv4 UDP to port 67 up to
Python: no port is opened in the node's input chain, and the rest of the
guest's traffic never reaches this code.

Invariants:
  - the only address ever offered is the sandbox's own (its /30 from the
    node's pool), with its gateway and resolver at the host end: whatever a
    guest asks for, by any client id or MAC, it gets that one or a NAK;
  - a frame is parsed with every length checked against what arrived; a
    malformed one is dropped, never answered, never raised;
  - at most RATE frames a second per sandbox are read, answered or not;
    past that the socket is left unread and the kernel drops the flood;
  - replies go out on the sandbox's own veth only: to the broadcast
    addresses (the segment holds the guest alone), or, to a client that
    already holds its address, to that address and its MAC.
"""

from __future__ import annotations

import asyncio
import ctypes
import ipaddress
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

from corral.log import get_logger

log = get_logger("corral.dhcp")

SERVER_PORT, CLIENT_PORT = 67, 68
ETH_P_IP = 0x0800
SO_ATTACH_FILTER = 26
PACKET_OUTGOING = 4
MAGIC = b"\x63\x82\x53\x63"
BOOTP_FIXED = 236  # op .. file, before the magic cookie
MIN_BOOTP = 300  # BOOTP's minimum message; some clients drop shorter replies
RATE = 20  # frames read a second per sandbox, answered or not, burst as many
# Renewed at half of it: rarely enough that an idle guest is seldom woken
# for it, often enough that an agent's restart (which answers again once
# recovery runs) is never noticed.
LEASE_SECONDS = 3600

DISCOVER, OFFER, REQUEST, DECLINE, ACK, NAK, RELEASE, INFORM = range(1, 9)
OPT_PAD, OPT_MASK, OPT_ROUTER, OPT_DNS, OPT_BROADCAST = 0, 1, 3, 6, 28
OPT_REQUESTED, OPT_LEASE, OPT_TYPE, OPT_SERVER, OPT_T1, OPT_T2, OPT_END = (
    50, 51, 53, 54, 58, 59, 255,
)  # fmt: skip

# Classic BPF over Ethernet frames: IPv4, UDP, not a fragment, destination
# port 67 (tcpdump's `udp dst port 67`, IPv4 only). Accepted frames come up
# whole; everything else stays in the kernel.
_FILTER = [
    (0x28, 0, 0, 12),  # ldh [12]            ethertype
    (0x15, 0, 8, ETH_P_IP),  # jeq IPv4, else drop
    (0x30, 0, 0, 23),  # ldb [23]            IP protocol
    (0x15, 0, 6, 17),  # jeq UDP, else drop
    (0x28, 0, 0, 20),  # ldh [20]            flags + fragment offset
    (0x45, 4, 0, 0x1FFF),  # jset offset: a later fragment, drop
    (0xB1, 0, 0, 14),  # ldxb 4*([14]&0xf)   X = IP header length
    (0x48, 0, 0, 16),  # ldh [x+16]          UDP destination port
    (0x15, 0, 1, SERVER_PORT),  # jeq 67, else drop
    (0x06, 0, 0, 0xFFFF),  # ret: the frame
    (0x06, 0, 0, 0),  # ret: nothing
]


@dataclass(frozen=True)
class Lease:
    """What a sandbox's guest is given: its address in a /30 whose other
    host address is the gateway (and its resolver, guard/dns.py)."""

    address: str
    gateway: str
    prefix: int = 30
    seconds: int = LEASE_SECONDS

    @property
    def mask(self) -> bytes:
        return ipaddress.IPv4Network(f"0.0.0.0/{self.prefix}").netmask.packed

    @property
    def broadcast(self) -> bytes:
        net = ipaddress.IPv4Network(f"{self.address}/{self.prefix}", strict=False)
        return net.broadcast_address.packed


@dataclass(frozen=True)
class Request:
    """A client's BOOTREQUEST, as far as answering it needs."""

    xid: bytes
    flags: bytes
    ciaddr: bytes
    chaddr: bytes  # 16 bytes, as sent
    kind: int | None  # the DHCP message type; None: plain BOOTP
    requested: bytes | None  # option 50
    server: bytes | None  # option 54


def parse(frame: bytes) -> Request | None:
    """The BOOTREQUEST an Ethernet frame carries, or None for anything else."""
    if len(frame) < 14 + 20 + 8 or frame[12:14] != b"\x08\x00":
        return None
    ip = frame[14:]
    ihl = (ip[0] & 0x0F) * 4
    total = int.from_bytes(ip[2:4], "big")
    if ip[0] >> 4 != 4 or ihl < 20 or ip[9] != 17 or total > len(ip) or total < ihl + 8:
        return None
    if int.from_bytes(ip[6:8], "big") & 0x3FFF:  # more fragments, or an offset
        return None
    udp = ip[ihl:total]
    length = int.from_bytes(udp[4:6], "big")
    if int.from_bytes(udp[2:4], "big") != SERVER_PORT or length < 8 or length > len(udp):
        return None
    msg = udp[8:length]
    if len(msg) < BOOTP_FIXED or msg[0] != 1 or msg[1] != 1 or msg[2] != 6:
        return None  # a BOOTREQUEST from Ethernet, 6-byte addresses
    options = (
        _options(msg[BOOTP_FIXED + 4 :]) if msg[BOOTP_FIXED : BOOTP_FIXED + 4] == MAGIC else {}
    )
    if options is None:
        return None
    kind = options.get(OPT_TYPE)
    requested = options.get(OPT_REQUESTED)
    server = options.get(OPT_SERVER)
    if (kind is not None and len(kind) != 1) or (requested is not None and len(requested) != 4):
        return None
    return Request(
        xid=msg[4:8],
        flags=msg[10:12],
        ciaddr=msg[12:16],
        chaddr=msg[28:44],
        kind=kind[0] if kind else None,
        requested=requested,
        server=server if server is not None and len(server) == 4 else None,
    )


def _options(data: bytes) -> dict[int, bytes] | None:
    """Options by code (a repeated code's parts joined, RFC 3396), or None
    if one runs past the end."""
    out: dict[int, bytes] = {}
    i = 0
    while i < len(data):
        code = data[i]
        if code == OPT_END:
            break
        if code == OPT_PAD:
            i += 1
            continue
        if i + 1 >= len(data) or i + 2 + data[i + 1] > len(data):
            return None
        out[code] = out.get(code, b"") + data[i + 2 : i + 2 + data[i + 1]]
        i += 2 + data[i + 1]
    return out


def answer(req: Request, lease: Lease, server_mac: bytes) -> bytes | None:
    """The Ethernet frame that answers `req`, or None when none is due
    (a RELEASE, a DECLINE, a request meant for another server)."""
    ours = socket.inet_aton(lease.address)
    server_ip = socket.inet_aton(lease.gateway)
    if req.kind is None:
        kind = None  # plain BOOTP: the address, no lease
    elif req.kind == DISCOVER:
        kind = OFFER
    elif req.kind == REQUEST:
        if req.server is not None and req.server != server_ip:
            return None  # the client chose another server's offer
        asked = req.requested or req.ciaddr
        kind = ACK if asked == ours else NAK
    elif req.kind == INFORM:
        kind = ACK
    else:
        return None
    yiaddr = ours if kind in (None, OFFER, ACK) and req.kind != INFORM else bytes(4)
    ciaddr = req.ciaddr if kind != NAK else bytes(4)
    # op (a reply), htype (Ethernet), hlen, hops, xid, secs, flags, ciaddr,
    # yiaddr, siaddr, giaddr, chaddr.
    head = struct.pack("!BBBB4sH2s", 2, 1, 6, 0, req.xid, 0, req.flags)
    msg = bytearray(head + ciaddr + yiaddr + bytes(8) + req.chaddr)
    msg += bytes(192)  # sname, file
    msg += MAGIC
    opts: list[tuple[int, bytes]] = []
    if kind is not None:
        opts.append((OPT_TYPE, bytes([kind])))
        opts.append((OPT_SERVER, server_ip))
    if kind != NAK:
        if kind in (OFFER, ACK) and req.kind != INFORM:
            opts += [
                (OPT_LEASE, lease.seconds.to_bytes(4, "big")),
                (OPT_T1, (lease.seconds // 2).to_bytes(4, "big")),
                (OPT_T2, (lease.seconds * 7 // 8).to_bytes(4, "big")),
            ]
        opts += [
            (OPT_MASK, lease.mask),
            (OPT_ROUTER, server_ip),
            (OPT_DNS, server_ip),
            (OPT_BROADCAST, lease.broadcast),
        ]
    for code, value in opts:
        msg += bytes([code, len(value)]) + value
    msg.append(OPT_END)
    if len(msg) < MIN_BOOTP:
        msg += bytes(MIN_BOOTP - len(msg))
    if kind != NAK and req.ciaddr == ours:
        # A client that holds its address (renewing) may listen on a socket
        # bound to it, and hear only what is sent to it (RFC 2131 4.1).
        return _frame(bytes(msg), server_ip, server_mac, ours, req.chaddr[:6])
    return _frame(bytes(msg), server_ip, server_mac)


def _checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071): a valid header's comes out 0."""
    if len(data) % 2:
        data += b"\x00"
    total: int = sum(int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _frame(
    payload: bytes,
    src_ip: bytes,
    src_mac: bytes,
    dst_ip: bytes = b"\xff" * 4,
    dst_mac: bytes = b"\xff" * 6,
) -> bytes:
    udp_len = 8 + len(payload)
    pseudo = src_ip + dst_ip + struct.pack("!BBH", 0, 17, udp_len)
    udp = struct.pack("!HHHH", SERVER_PORT, CLIENT_PORT, udp_len, 0) + payload
    udp_sum = _checksum(pseudo + udp) or 0xFFFF
    udp = udp[:6] + struct.pack("!H", udp_sum) + udp[8:]
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0x10, 20 + udp_len, 0, 0, 64, 17, 0, src_ip, dst_ip)
    ip = ip[:10] + struct.pack("!H", _checksum(ip)) + ip[12:]
    return dst_mac + src_mac + b"\x08\x00" + ip + udp


def mac_bytes(mac: str) -> bytes:
    return bytes(int(part, 16) for part in mac.split(":"))


class Responder:
    """Answers one sandbox's guest on `ifname` (the host end of its veth)
    until closed. Runs on the node agent's event loop.

    Every frame the kernel lets up costs a token (RATE a second, burst as
    many), answered or not, before it is parsed; with none left the socket
    is not read until one comes back, so a flood waits in the socket's
    small buffer and the kernel drops the rest: a guest can make the node
    do RATE frames' work a second, no more. `on_gone` is called once the
    veth has gone (its QEMU ended) and the responder has closed itself."""

    def __init__(
        self,
        sandbox_id: str,
        ifname: str,
        lease: Lease,
        server_mac: str,
        on_gone: Callable[[Responder], None] | None = None,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.ifname = ifname
        self.lease = lease
        self.server_mac = mac_bytes(server_mac)
        self.on_gone = on_gone
        self.answered = 0
        self.dropped = 0  # frames left unread past RATE (at least; the kernel drops more)
        self._tokens = float(RATE)
        self._refilled = time.monotonic()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._paused: asyncio.TimerHandle | None = None
        self._closed = False
        # Protocol 0 until bound: a packet socket made for a protocol hears
        # it from every interface at once, and what it queued before the
        # bind would be answered on this veth.
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        try:
            _attach_filter(self.sock)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            self.sock.bind((ifname, ETH_P_IP))
            self.sock.setblocking(False)
        except BaseException:
            self.sock.close()
            raise

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.sock.fileno(), self._readable)

    def close(self) -> None:
        """Stop answering; from the loop's thread or any other (a release
        runs in a worker thread). Idempotent."""
        loop = self._loop
        try:
            here = asyncio.get_running_loop()
        except RuntimeError:
            here = None
        if loop is not None and here is not loop:
            try:
                loop.call_soon_threadsafe(self.close)
                return
            except RuntimeError:  # that loop is closed: nothing reads for it any more
                self._loop = loop = None
        if self._closed:
            return
        self._closed = True
        if self._paused is not None:
            self._paused.cancel()
        if loop is not None:
            loop.remove_reader(self.sock.fileno())
            self._loop = None
        self.sock.close()

    def _readable(self) -> None:
        for _ in range(RATE):  # then back to the loop; the rest next time
            if not self._take():
                self._pause()
                return
            try:
                frame, addr = self.sock.recvfrom(2048)
            except (BlockingIOError, InterruptedError):
                self._tokens += 1  # nothing was read: the token stays
                return
            except OSError as exc:  # the veth went away (its QEMU ended)
                log.info("dhcp.gone", sandbox=self.sandbox_id, error=str(exc))
                self.close()
                if self.on_gone is not None:
                    self.on_gone(self)
                return
            if addr[0] != self.ifname or addr[2] == PACKET_OUTGOING:
                continue
            req = parse(frame)
            if req is None:
                continue
            reply = answer(req, self.lease, self.server_mac)
            if reply is None:
                continue
            try:
                self.sock.send(reply)
            except OSError as exc:
                log.warning("dhcp.send_failed", sandbox=self.sandbox_id, error=str(exc))
                continue
            self.answered += 1
            log.debug("dhcp.answered", sandbox=self.sandbox_id, request=req.kind)

    def _pause(self) -> None:
        """Stop reading until a token is back (the kernel holds or drops
        what comes meanwhile)."""
        if self._loop is None or self._paused is not None:
            return
        self.dropped += 1
        self._loop.remove_reader(self.sock.fileno())
        self._paused = self._loop.call_later(1.0 / RATE, self._resume)

    def _resume(self) -> None:
        self._paused = None
        if self._loop is not None and not self._closed:
            self._loop.add_reader(self.sock.fileno(), self._readable)

    def _take(self) -> bool:
        now = time.monotonic()
        self._tokens = min(float(RATE), self._tokens + (now - self._refilled) * RATE)
        self._refilled = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


def _attach_filter(sock: socket.socket) -> None:
    code = b"".join(struct.pack("HBBI", *insn) for insn in _FILTER)
    buf = ctypes.create_string_buffer(code, len(code))
    # struct sock_fprog: an unsigned short count, then a pointer (padded).
    prog = struct.pack("HL", len(_FILTER), ctypes.addressof(buf))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, prog)
