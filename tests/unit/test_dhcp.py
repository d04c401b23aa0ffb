"""The own-disk guest's DHCP (guard/dhcp.py): what each request gets, and
frames a hostile guest may send, each dropped without an answer."""

from __future__ import annotations

import socket
import struct

import pytest

from corral.guard import dhcp
from corral.guard.dhcp import Lease, answer, parse

LEASE = Lease("10.200.0.6", "10.200.0.5")
MAC = bytes.fromhex("525400123456")
SERVER_MAC = dhcp.mac_bytes("02:c0:00:00:00:01")


def bootp(kind: int | None, *, options: bytes = b"", op: int = 1, hlen: int = 6,
          ciaddr: bytes = bytes(4), magic: bool = True) -> bytes:  # fmt: skip
    msg = struct.pack("!BBBB4sHH4s4s4s4s16s", op, 1, hlen, 0, b"\x01\x02\x03\x04", 0, 0x8000,
                      ciaddr, bytes(4), bytes(4), bytes(4), MAC + bytes(10))  # fmt: skip
    msg += bytes(192)
    if magic:
        msg += dhcp.MAGIC
        if kind is not None:
            msg += bytes([dhcp.OPT_TYPE, 1, kind])
        msg += options + bytes([dhcp.OPT_END])
    return msg


def frame(payload: bytes, *, dport: int = 67, proto: int = 17, frag: int = 0,
          udp_len: int | None = None, ethertype: bytes = b"\x08\x00") -> bytes:  # fmt: skip
    udp = struct.pack("!HHHH", 68, dport, udp_len or 8 + len(payload), 0) + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, frag, 64, proto, 0,
                     bytes(4), b"\xff" * 4)  # fmt: skip
    return b"\xff" * 6 + MAC + ethertype + ip + udp


def reply_of(kind: int | None, **kw: bytes) -> tuple[bytes, dict[int, bytes]]:
    """(the reply's BOOTP message, its options) for a request of `kind`."""
    req = parse(frame(bootp(kind, **kw)))
    assert req is not None
    out = answer(req, LEASE, SERVER_MAC)
    assert out is not None
    ip = out[14:34]
    assert dhcp._checksum(ip) == 0, "the IP header's checksum"
    assert ip[12:16] == socket.inet_aton(LEASE.gateway) and out[6:12] == SERVER_MAC
    if req.ciaddr == socket.inet_aton(LEASE.address) and out[14 + 20 + 8 + 240 + 2] != dhcp.NAK:
        # To a client that holds its address: that address, its MAC.
        assert out[:6] == MAC and ip[16:20] == req.ciaddr
    else:
        assert out[:6] == b"\xff" * 6 and ip[16:20] == b"\xff" * 4
    pseudo = ip[12:20] + bytes([0, 17]) + out[38:40]
    assert dhcp._checksum(pseudo + out[34:]) == 0, "the UDP checksum"
    udp = out[34:]
    assert struct.unpack("!HH", udp[:4]) == (67, 68)
    msg = udp[8:]
    assert len(msg) >= dhcp.MIN_BOOTP and msg[0] == 2 and msg[4:8] == b"\x01\x02\x03\x04"
    assert msg[28:34] == MAC
    opts = dhcp._options(msg[dhcp.BOOTP_FIXED + 4 :]) or {}
    return msg, opts


def test_a_discover_is_offered_the_sandboxs_own_address() -> None:
    msg, opts = reply_of(dhcp.DISCOVER)
    assert msg[16:20] == socket.inet_aton("10.200.0.6")
    assert opts[dhcp.OPT_TYPE] == bytes([dhcp.OFFER])
    assert opts[dhcp.OPT_SERVER] == socket.inet_aton("10.200.0.5")
    assert opts[dhcp.OPT_MASK] == socket.inet_aton("255.255.255.252")
    assert opts[dhcp.OPT_ROUTER] == opts[dhcp.OPT_DNS] == socket.inet_aton("10.200.0.5")
    assert opts[dhcp.OPT_BROADCAST] == socket.inet_aton("10.200.0.7")
    assert int.from_bytes(opts[dhcp.OPT_LEASE], "big") == dhcp.LEASE_SECONDS


@pytest.mark.parametrize(
    ("options", "ciaddr", "kind"),
    [
        (bytes([50, 4, 10, 200, 0, 6]), bytes(4), dhcp.ACK),  # selecting its offer
        (b"", bytes([10, 200, 0, 6]), dhcp.ACK),  # renewing
        (bytes([50, 4, 10, 200, 0, 10]), bytes(4), dhcp.NAK),  # another address
        (bytes([50, 4, 10, 200, 0, 6, 54, 4, 10, 200, 0, 5]), bytes(4), dhcp.ACK),
    ],
)
def test_a_request_is_acked_only_for_its_own_address(
    options: bytes, ciaddr: bytes, kind: int
) -> None:
    msg, opts = reply_of(dhcp.REQUEST, options=options, ciaddr=ciaddr)
    assert opts[dhcp.OPT_TYPE] == bytes([kind])
    if kind == dhcp.NAK:
        assert msg[16:20] == bytes(4) and dhcp.OPT_ROUTER not in opts
    else:
        assert msg[16:20] == socket.inet_aton("10.200.0.6")


def test_inform_gets_the_settings_and_plain_bootp_the_address() -> None:
    msg, opts = reply_of(dhcp.INFORM)
    assert opts[dhcp.OPT_TYPE] == bytes([dhcp.ACK]) and dhcp.OPT_LEASE not in opts
    assert msg[16:20] == bytes(4) and dhcp.OPT_ROUTER in opts
    msg, opts = reply_of(None)
    assert msg[16:20] == socket.inet_aton("10.200.0.6") and dhcp.OPT_TYPE not in opts


@pytest.mark.parametrize(
    "req",
    [
        bootp(dhcp.RELEASE),
        bootp(dhcp.DECLINE),
        bootp(99),
        # The client chose another server's offer.
        bootp(dhcp.REQUEST, options=bytes([50, 4, 10, 200, 0, 6, 54, 4, 10, 0, 0, 1])),
    ],
)
def test_what_needs_no_answer_gets_none(req: bytes) -> None:
    parsed = parse(frame(req))
    assert parsed is not None
    assert answer(parsed, LEASE, SERVER_MAC) is None


GOOD = bootp(dhcp.DISCOVER)


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        (b"", "empty"),
        (frame(GOOD)[:40], "shorter than the headers"),
        (frame(GOOD, ethertype=b"\x86\xdd"), "not IPv4"),
        (frame(GOOD, proto=6), "not UDP"),
        (frame(GOOD, frag=0x2000), "the first of fragments"),
        (frame(GOOD, frag=0x0010), "a later fragment"),
        (frame(GOOD, dport=68), "not to the server's port"),
        (frame(GOOD, udp_len=4), "a UDP length under its header"),
        (frame(GOOD, udp_len=4000), "a UDP length past the frame"),
        (frame(GOOD)[:-100], "an IP length past the frame"),
        (frame(bootp(dhcp.DISCOVER, op=2)), "a reply, not a request"),
        (frame(bootp(dhcp.DISCOVER, hlen=16)), "not 6-byte addresses"),
        (frame(GOOD[:200]), "a BOOTP message cut short"),
        (frame(bootp(dhcp.DISCOVER, options=bytes([12, 200, 1]))), "an option past the end"),
        (frame(bootp(None, options=bytes([53, 2, 1, 1]))), "a message type of two bytes"),
        (frame(bootp(dhcp.REQUEST, options=bytes([50, 3, 1, 2, 3]))), "a 3-byte address"),
    ],
)
def test_malformed_frames_are_dropped(bad: bytes, why: str) -> None:
    assert parse(bad) is None, why


def test_the_kernel_filter_is_well_formed() -> None:
    """Every jump lands inside the program, on a return or further on."""
    for i, (code, jt, jf, _) in enumerate(dhcp._FILTER):
        if code & 0x07 == 0x05:  # BPF_JMP
            assert i + 1 + jt < len(dhcp._FILTER) and i + 1 + jf < len(dhcp._FILTER)
    assert dhcp._FILTER[-1] == (0x06, 0, 0, 0) and dhcp._FILTER[-2][0] == 0x06
