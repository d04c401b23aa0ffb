"""Process identity on the host: a pid alone is reused by the kernel, so
every process the node records is recorded as (pid, start time), and an
owner (an agent process) as the token "<pid>:<start time>"."""

from __future__ import annotations

import os


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat: tells a process from a later one
    that reused its pid. None if there is no such process, or only its
    zombie (it has exited; its parent has not collected it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def alive(pid: int | None, start: int | None) -> bool:
    """Whether the process recorded as (pid, start) still runs."""
    return pid is not None and process_start_time(pid) == start


def owner_token() -> str:
    """This process, as an owner of records."""
    return f"{os.getpid()}:{process_start_time(os.getpid())}"


def owner_alive(token: str) -> bool:
    pid, _, start = token.partition(":")
    return str(process_start_time(int(pid))) == start


def host_memory() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")
