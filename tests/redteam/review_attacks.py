"""Attacks from the outside security review (issue 14), by class. Each
returns an Outcome like those in attacks.py; several variants per class."""

from __future__ import annotations

import json

import corral

from .attacks import Outcome, _py

# Machine code for one int 0x80 call from a 64-bit process: the 32-bit
# entry, which seccomp sees under AUDIT_ARCH_I386 with i386 numbers.
INT80 = r"""
import ctypes, json, mmap, struct
def int80(nr, *args):
    a = list(args) + [0] * (5 - len(args))
    code = b"\x53\xb8" + struct.pack("<I", nr)                    # push rbx; mov eax, nr
    for op, v in zip((b"\xbb", b"\xb9", b"\xba", b"\xbe", b"\xbf"), a):
        code += op + struct.pack("<I", v & 0xFFFFFFFF)              # ebx, ecx, edx, esi, edi
    code += b"\xcd\x80\x5b\xc3"                                   # int 0x80; pop rbx; ret
    m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    m.write(code)
    return ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))()
calls = {  # i386 numbers
  "getpid": (20,), "mount": (21, 0, 0, 0, 0, 0), "ptrace": (26, 16, 1), "unshare": (310, 0x20000),
  "setns": (346, 0, 0), "keyctl": (288, 0), "bpf": (357, 0, 0, 0), "init_module": (128, 0, 0, 0),
  "kexec_load": (283, 0, 0, 0, 0), "userfaultfd": (374, 0), "perf_event_open": (336, 0, 0, 0, 0, 0),
  "vsock": (359, 40, 1, 0),  # socket(AF_VSOCK, SOCK_STREAM, 0)
}
print(json.dumps({k: int80(*v) for k, v in calls.items()}))
"""

PRIVILEGED_32 = ("mount", "ptrace", "unshare", "setns", "keyctl", "bpf", "init_module",
                 "kexec_load", "userfaultfd", "perf_event_open")  # fmt: skip


async def int80_syscalls(sbx: corral.AsyncSandbox) -> Outcome:
    """Class 10: privileged syscalls through the 32-bit entry. Each must be
    refused (EPERM, or EAFNOSUPPORT for a socket) exactly as its 64-bit
    twin, and counted as that twin, not as "other"."""
    r = await sbx.commands.run(_py(INT80))
    res = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}
    ok = (
        bool(res)
        and res["getpid"] > 0  # the 32-bit entry itself works
        and all(res[k] == -1 for k in PRIVILEGED_32)  # -EPERM
        and res["vsock"] == -97  # -EAFNOSUPPORT
    )
    return Outcome(ok, f"results {res} {r.stderr[-300:]}")


SOCKETS = r"""
import ctypes, json, socket
libc = ctypes.CDLL(None, use_errno=True)
def make(family, kind, proto=0):
    try:
        socket.socket(family, kind, proto).close()
        return 0
    except OSError as e:
        return e.errno
def raw(family, kind, proto=0):  # the whole 64-bit argument, as a caller may pass it
    r = libc.syscall(41, ctypes.c_long(family), ctypes.c_long(kind), ctypes.c_long(proto))
    return 0 if r >= 0 else ctypes.get_errno()
def pair(family):
    try:
        a, b = socket.socketpair(family, socket.SOCK_STREAM)
        a.close(); b.close()
        return 0
    except OSError as e:
        return e.errno
print(json.dumps({
  "vsock": make(40, socket.SOCK_STREAM), "packet": make(17, socket.SOCK_RAW),
  "bluetooth": make(31, socket.SOCK_STREAM, 3), "alg": make(38, socket.SOCK_SEQPACKET),
  "key": make(15, socket.SOCK_RAW, 2), "netlink_uevent": make(16, socket.SOCK_DGRAM, 15),
  "netlink_audit": make(16, socket.SOCK_RAW, 9), "netlink_sock_diag": make(16, socket.SOCK_RAW, 4),
  "inet_upper_bits": raw((1 << 32) | 2, socket.SOCK_STREAM), "pair_vsock": pair(40),
  "unix": make(1, socket.SOCK_STREAM), "inet": make(2, socket.SOCK_STREAM),
  "inet6": make(10, socket.SOCK_DGRAM), "netlink_route": make(16, socket.SOCK_RAW, 0),
  "pair_unix": pair(1),
}))
"""
REFUSED_FAMILIES = ("vsock", "packet", "bluetooth", "alg", "key", "netlink_uevent",
                    "netlink_audit", "netlink_sock_diag", "inet_upper_bits", "pair_vsock")  # fmt: skip
ALLOWED_FAMILIES = ("unix", "inet", "inet6", "netlink_route", "pair_unix")


async def socket_families(sbx: corral.AsyncSandbox) -> Outcome:
    """Class 4: every family but unix, inet, inet6 and netlink route is
    refused with EAFNOSUPPORT; the allowed ones still work."""
    r = await sbx.commands.run(_py(SOCKETS))
    res = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}
    ok = (
        bool(res)
        and all(res[k] == 97 for k in REFUSED_FAMILIES)
        and all(res[k] == 0 for k in ALLOWED_FAMILIES)
    )
    return Outcome(ok, f"errnos {res} {r.stderr[-300:]}")


async def direct_io_stream(sbx: corral.AsyncSandbox, mib: int = 384) -> Outcome:
    """Class 6: stream to and from the scratch pool bypassing the page cache
    (O_DIRECT), the I/O a node throttles per sandbox (docs/guard.md says
    what a v1 host cannot throttle)."""
    r = await sbx.commands.run(
        f"dd if=/dev/zero of=/stream bs=1M count={mib} oflag=direct 2>&1 | tail -1; "
        f"dd if=/stream of=/dev/null bs=1M iflag=direct 2>&1 | tail -1; rm -f /stream",
        timeout=120,
    )
    rates = []
    for line in r.stdout.splitlines():
        # "402653184 bytes (403 MB, 384 MiB) copied, 3.01 s, 134 MB/s"
        parts = line.split(", ")
        if len(parts) >= 3 and parts[-2].endswith(" s"):
            rates.append(int(line.split()[0]) / float(parts[-2].removesuffix(" s")))
    return Outcome(len(rates) == 2, f"{r.stdout.strip()} {r.stderr[-200:]}", {"rates": rates})


DNS_FLOOD = r"""
import os, socket, struct, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setblocking(False)
ns = open("/etc/resolv.conf").read().split()[1]
sent, end = 0, time.time() + float(os.environ.get("SECONDS_", "6"))
while time.time() < end:
    name = os.urandom(8).hex() + ".refused.test"
    q = struct.pack(">HHHHHH", sent & 0xFFFF, 0x0100, 1, 0, 0, 0)
    q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0\0\1\0\1"
    try:
        s.sendto(q, (ns, 53)); sent += 1
    except BlockingIOError:
        pass
    try:
        while s.recv(512): pass
    except BlockingIOError:
        pass
print(sent)
"""


async def dns_flood(sbx: corral.AsyncSandbox, seconds: float = 6.0) -> Outcome:
    """Class 5: refused names sent to the node's resolver as fast as one
    process can; the neighbour (on the same event loop's agent) must not
    notice."""
    r = await sbx.commands.run(_py(DNS_FLOOD), env={"SECONDS_": str(seconds)}, timeout=seconds + 30)
    sent = int(r.stdout.strip() or 0)
    return Outcome(sent > 1000, f"sent {sent} queries {r.stderr[-300:]}", {"sent": sent})


SETUID = r"""
set -e
cp /bin/id /usr/local/bin/corral-suid-id && chmod 4755 /usr/local/bin/corral-suid-id
cp /bin/sh /usr/local/bin/corral-suid-sh && chmod 6755 /usr/local/bin/corral-suid-sh
stat -c '%a %U' /usr/local/bin/corral-suid-id
"""


COUNTERS = r"""
import ctypes, json, os, sys, tempfile
libc = ctypes.CDLL(None, use_errno=True)
def errno_of(r):
    return 0 if r >= 0 else ctypes.get_errno()
# inotify instances until refused
fds = []
while len(fds) < 100000:
    fd = libc.inotify_init1(0)
    if fd < 0:
        break
    fds.append(fd)
instances = len(fds)
# watches on one instance until refused (each on its own directory)
base = tempfile.mkdtemp()
watches = 0
fd = fds[0] if fds else libc.inotify_init1(0)
while watches < 200000:
    d = os.path.join(base, str(watches))
    os.mkdir(d)
    if libc.inotify_add_watch(fd, d.encode(), 0x100) < 0:
        break
    watches += 1
class Attr(ctypes.Structure):
    _fields_ = [("f", ctypes.c_long), ("m", ctypes.c_long), ("s", ctypes.c_long), ("c", ctypes.c_long), ("p", ctypes.c_long * 4)]
mq = errno_of(libc.mq_open(b"/corral-q", os.O_CREAT | os.O_RDWR, 0o600, ctypes.byref(Attr(0, 10, 8192, 0))))
aio = []
for n in map(int, sys.argv[1:]):
    ctx = ctypes.c_ulong(0)
    aio.append(errno_of(libc.syscall(206, n, ctypes.byref(ctx))))
print(json.dumps({"instances": instances, "watches": watches, "mq": mq, "aio": aio}))
"""


async def kernel_counters(sbx: corral.AsyncSandbox, *aio: int) -> dict[str, object]:
    """Class 3: take as much of each host-wide kernel counter as allowed."""
    r = await sbx.commands.run(_py(COUNTERS) + [str(n) for n in aio], timeout=120)
    return json.loads(r.stdout) if r.stdout.strip().startswith("{") else {"error": r.stderr}
