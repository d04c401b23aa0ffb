"""The agent's side of corral-seccompd: start it, and read what it counted."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import subprocess
import time
from pathlib import Path

from corral.errors import Unavailable
from corral.guard import seccomp
from corral.log import get_logger

log = get_logger("corral.seccompd")
SLOTS = 1024
OTHER_ARCH = SLOTS - 1
# It binds its socket within milliseconds on a host, but took over 10 s in
# the v2 test host's emulated guest under load (tests/framework/v2host.py).
# A daemon not up after this is refused; one that exits is seen at once.
START_TIMEOUT = 30.0
# The kernel's syscall tables as the C library's headers spell them.
UNISTD = Path("/usr/include/x86_64-linux-gnu/asm")
_NR = re.compile(r"^#define __NR_(\w+)\s+(\d+)$", re.M)


def _table(header: Path) -> dict[str, int]:
    try:
        return {name: int(nr) for name, nr in _NR.findall(header.read_text())}
    except OSError:
        return {}


def i386_twins(headers: Path = UNISTD) -> dict[int, int]:
    """i386 syscall number -> the x86_64 number of the syscall of the same
    name: a refused call through int 0x80 is answered and counted as its
    64-bit twin. Empty where the headers are absent (such calls are then
    counted as "other", still refused)."""
    nr64 = _table(headers / "unistd_64.h")
    return {nr: nr64[name] for name, nr in _table(headers / "unistd_32.h").items() if name in nr64}


def policy_lines(twins: dict[int, int] | None = None, aio_events: int = 65536) -> str:
    """`nr errno` for every refused syscall that is not merely unknown, then
    `i386 nr32 nr64` for every 32-bit twin, and each sandbox's AIO budget."""
    lines = [f"aio {aio_events}", f"{seccomp.NR_IO_SETUP} {seccomp.EAGAIN}",
             f"{seccomp.NR_MQ_OPEN} 1"]  # fmt: skip
    lines += [f"{nr} 1" for nr in sorted(seccomp.PRIVILEGED)]
    lines += [f"{seccomp.NR_IOCTL} 1", f"{seccomp.NR_CLONE} 1", f"{seccomp.NR_PERSONALITY} 1"]
    lines += [f"{nr} {seccomp.EAFNOSUPPORT}" for nr in (seccomp.NR_SOCKET, seccomp.NR_SOCKETPAIR)]
    twins = i386_twins() if twins is None else twins
    lines += [f"i386 {nr32} {nr64}" for nr32, nr64 in sorted(twins.items())]
    return "\n".join(lines) + "\n"


def syscall_class(nr: int) -> tuple[str, str]:
    """(class, name) of a counter slot."""
    if nr == OTHER_ARCH:
        return "other", "non-x86_64 syscall"
    if nr in seccomp.PRIVILEGED:
        return "privileged", seccomp.PRIVILEGED[nr]
    if nr == seccomp.NR_IOCTL:
        return "extent-ioctl", "ioctl"
    if nr == seccomp.NR_CLONE:
        return "namespace", "clone"
    if nr == seccomp.NR_PERSONALITY:
        return "privileged", "personality"
    if nr in (seccomp.NR_SOCKET, seccomp.NR_SOCKETPAIR):
        return "socket-family", "socket" if nr == seccomp.NR_SOCKET else "socketpair"
    if nr == seccomp.NR_IO_SETUP:
        return "kernel-quota", "io_setup"
    if nr == seccomp.NR_MQ_OPEN:
        return "kernel-quota", "mq_open"
    return "other", f"syscall {nr}"


# Descriptors the daemon keeps besides its listeners: stdio, its socket,
# the lock, a counts file open while it counts, one accepted connection.
OWN_FILES = 16


def listener_capacity(limits: Path) -> int | None:
    """The listeners a process with these /proc/<pid>/limits can hold."""
    try:
        text = limits.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Max open files"):
            soft = line[len("Max open files") :].split()[0]
            return None if soft == "unlimited" else max(0, int(soft) - OWN_FILES)
    return None


class SeccompDaemon:
    def __init__(self, data_dir: Path, binary: Path, aio_events: int = 65536) -> None:
        self.binary = binary
        self.aio_events = aio_events
        self.socket = data_dir / "run" / "seccomp.sock"
        self.audit_dir = data_dir / "audit"
        self.lock = data_dir / "seccompd.lock"
        # Held by the agent that checks for a daemon and starts one: two
        # agents of a node that both found none started two, and the one
        # that lost the daemon's own lock failed its create.
        self.start_lock = data_dir / "seccompd.start.lock"
        self.policy = data_dir / "run" / "seccomp.policy"
        self.log_file = data_dir / "seccompd.log"

    def running_pid(self) -> int | None:
        try:
            fd = os.open(self.lock, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode().strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        return None

    def listener_capacity(self) -> int | None:
        """How many sandboxes' listeners the running daemon can hold: one
        open file each, under its soft RLIMIT_NOFILE (raised to its hard
        one at start), less what it keeps open for itself and opens to
        count. None when no daemon runs or its limits cannot be read."""
        pid = self.running_pid()
        if pid is None or pid < 0:
            return None
        return listener_capacity(Path(f"/proc/{pid}/limits"))

    def ensure(self) -> bool:
        """Start the daemon unless one serves this node already; True if
        this call started it."""
        self.start_lock.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.start_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # the kernel drops it with its holder
            return self._ensure_locked()
        finally:
            os.close(fd)

    def _ensure_locked(self) -> bool:
        if self._serving():
            return False
        self.audit_dir.mkdir(parents=True, exist_ok=True)
        self.policy.write_text(policy_lines(aio_events=self.aio_events))
        with open(self.log_file, "ab") as out:
            proc = subprocess.Popen(
                [
                    str(self.binary),
                    "--listen",
                    str(self.socket),
                    "--audit-dir",
                    str(self.audit_dir),
                    "--policy",
                    str(self.policy),
                    "--lock",
                    str(self.lock),
                ],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while self.running_pid() is None or not self.socket.exists():
            rc = proc.poll()
            if rc is not None or time.monotonic() > deadline:
                how = f"it exited ({rc})" if rc is not None else f"not up in {START_TIMEOUT:.0f} s"
                said = self.log_file.read_text(errors="replace")[-1500:].strip()
                raise Unavailable(
                    f"corral-seccompd did not start: {how}; {self.log_file} says: {said or '-'}"
                )
            time.sleep(0.01)
        log.info("seccompd.started", pid=proc.pid)
        return True

    def _serving(self) -> bool:
        """A daemon serves the node: its lock held and its socket there.
        One another agent has just started may not have bound its socket
        yet (the run tmpfs is new): waited for as long as a start may take,
        rather than started twice (stopping a slow one broke the creates of
        the agent that started it). One whose socket is gone (its run dir
        unmounted under it) is stopped, and False returned."""
        deadline = time.monotonic() + START_TIMEOUT
        while self.running_pid() is not None:
            if self.socket.exists():
                return True
            if time.monotonic() > deadline:
                log.warning("seccompd.socket_gone", socket=str(self.socket))
                self.stop()
                return False
            time.sleep(0.01)
        return False

    def stop(self, wait: float = 5.0) -> None:
        """SIGTERM the daemon; return once it has let go of its lock (a
        start right after finds none running), or after `wait` seconds."""
        pid = self.running_pid()
        if not pid or pid < 0:
            return
        try:
            os.kill(pid, 15)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while self.running_pid() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # ours (this process started it): no zombie

    def counts(self, sandbox_id: str) -> dict[int, int]:
        try:
            raw = (self.audit_dir / f"{sandbox_id}.seccomp").read_bytes()
        except FileNotFoundError:
            return {}
        values = memoryview(raw).cast("Q")
        return {i: int(v) for i, v in enumerate(values) if v}

    def counted(self) -> list[str]:
        """The sandboxes the daemon keeps a counts file for."""
        try:
            return [
                n.removesuffix(".seccomp")
                for n in os.listdir(self.audit_dir)
                if n.endswith(".seccomp")
            ]
        except FileNotFoundError:
            return []

    def forget(self, sandbox_id: str) -> None:
        (self.audit_dir / f"{sandbox_id}.seccomp").unlink(missing_ok=True)
