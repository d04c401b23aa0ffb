"""Run in the v2 host's guest before its command (tests/framework/v2host.py):
turn on, once, the kernel's static keys that Corral's work would turn on and
off again, and hold them on, so the kernel never patches its code while
both vCPUs run.

Why: under multi-threaded TCG the guest panicked about once in three runs,
each time one byte into an instruction the kernel patches when a static key
flips (an int3 at __schedule+0x407, a NOP in __alloc_pages): QEMU's vCPU
threads race the patch. Traced in the guest (kprobes on the static key
calls and the patching), three container rounds flipped ten batches of
sites: the cpuset keys on and off with every sandbox cgroup, the memory
cgroup keys, CFS bandwidth with the first cpu.max, the inet hash secrets'
one-time keys with the first TCP connection, and perf_sched_events with
every CRIU run (on by criu, off by a kworker). Held as below, the same
rounds flip none.

The caller takes the second vCPU offline first and brings it back once
this prints "held": the one-time flips happen with one vCPU running.
This process then stays, holding the perf event, until the guest powers off.
"""

from __future__ import annotations

import ctypes
import os
import socket
import time
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup/v2host-keys")
PERF_TYPE_SOFTWARE = 1
PERF_COUNT_SW_DUMMY = 9
SYS_PERF_EVENT_OPEN = 298  # x86_64


def hold_cgroup_keys() -> None:
    """An empty cgroup of every controller, with a CPU quota: the cpuset,
    memory cgroup and CFS bandwidth keys stay on while it exists."""
    CGROUP.mkdir(exist_ok=True)
    (CGROUP / "cpu.max").write_text("100000 100000\n")


def connect_once(family: int, host: str) -> None:
    """A TCP connection: the inet hash secrets' one-time keys flip now."""
    with socket.socket(family, socket.SOCK_STREAM) as srv:
        srv.bind((host, 0))
        srv.listen(1)
        with socket.create_connection(srv.getsockname()[:2]):
            srv.accept()[0].close()


def hold_perf_sched_events() -> int:
    """A per-task perf event (a dummy software one) holds perf_sched_events
    on; CRIU's own then never flip it."""
    attr = bytearray(128)  # struct perf_event_attr, zeroed: size, type, config
    attr[0:4] = PERF_TYPE_SOFTWARE.to_bytes(4, "little")
    attr[4:8] = len(attr).to_bytes(4, "little")
    attr[8:16] = PERF_COUNT_SW_DUMMY.to_bytes(8, "little")
    libc = ctypes.CDLL(None, use_errno=True)
    buf = (ctypes.c_char * len(attr)).from_buffer(attr)
    fd = libc.syscall(SYS_PERF_EVENT_OPEN, buf, 0, -1, -1, 0)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "perf_event_open")
    return int(fd)


def main() -> None:
    hold_cgroup_keys()
    connect_once(socket.AF_INET, "127.0.0.1")
    connect_once(socket.AF_INET6, "::1")
    hold_perf_sched_events()  # its fd stays open as long as this process
    print("held", flush=True)
    os.close(1)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
