"""What `cluster up` checks before it starts anything: that every port it
will listen on is free and distinct, and that the directories it will use
can be made and entered by the users that will use them.

A failure here starts nothing, so there is nothing to stop; each error
names the flag, the rule and the value (and, for a port in use, who holds it).
"""

from __future__ import annotations

import errno
import pwd
import socket
import subprocess
from pathlib import Path

from corral.errors import InvalidArgument, Unavailable


def _holder(port: int) -> str:
    """Who listens on `port`, as ss says (best effort: '' if unknown)."""
    try:
        out = subprocess.run(
            ["ss", "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, timeout=5
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    users = out.split("users:", 1)[1].strip() if "users:" in out else ""
    return f" (held by {users})" if users else ""


def port_free(host: str, port: int, udp: bool = False) -> int | None:
    """None if `port` can be bound on `host`, else the errno."""
    kind = socket.SOCK_DGRAM if udp else socket.SOCK_STREAM
    with socket.socket(socket.AF_INET, kind) as s:
        if not udp:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno or errno.EADDRINUSE
    return None


def check_ports(ports: dict[str, tuple[str, int, bool]]) -> None:
    """`ports`: flag -> (host, port, also UDP). Each must be in 1..65535,
    distinct from the others, and free now."""
    seen: dict[int, str] = {}
    for flag, (host, port, udp) in ports.items():
        if not 1 <= port <= 65535:
            raise InvalidArgument(flag, "must be a TCP port between 1 and 65535", port)
        if port in seen:
            raise InvalidArgument(flag, f"must differ from {seen[port]} (both are {port})", port)
        seen[port] = flag
        for proto in ("tcp", "udp") if udp else ("tcp",):
            err = port_free(host, port, udp=proto == "udp")
            if err == errno.EADDRINUSE:
                option = "--" + flag.split()[0].replace("_", "-")
                raise InvalidArgument(
                    flag, f"must be a free port: {proto} {host}:{port} is in use"
                    f"{_holder(port)}; choose another with {option}", port,
                )  # fmt: skip
            if err is not None:
                raise InvalidArgument(
                    flag, f"must be a port this user can bind on {host}: {errno.errorcode[err]}",
                    port,
                )  # fmt: skip


def _nearest(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_dir(directory: Path, *, for_postgres: bool) -> None:
    """The cluster directory can be made (or is a directory), and, when a
    PostgreSQL of ours will keep its data in it, the postgres user can
    enter it: PostgreSQL refuses to run as root, so initdb runs as postgres."""
    if not directory.is_absolute():
        raise InvalidArgument("dir", "must be an absolute path", str(directory))
    found = _nearest(directory)
    if not found.is_dir():
        raise InvalidArgument("dir", f"must be a directory: {found} is a file", str(directory))
    if directory.exists() and not directory.is_dir():
        raise InvalidArgument("dir", "must be a directory", str(directory))
    if for_postgres:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            raise Unavailable(
                "PostgreSQL is not installed (no postgres user): apt install postgresql, or "
                "pass --state postgresql://... of a running server"
            ) from None
        # The nearest existing ancestor: if postgres can enter it, the
        # directories made below it (0755) are enterable too.
        r = subprocess.run(
            ["runuser", "-u", "postgres", "--", "test", "-x", str(found)],
            capture_output=True,
        )
        if r.returncode != 0:
            blocker = found
            for parent in [found, *found.parents]:
                if parent.exists() and not (parent.stat().st_mode & 0o001):
                    blocker = parent
            raise InvalidArgument(
                "dir",
                "must be a directory the postgres user can enter (the state store runs as "
                f"postgres): {blocker} is mode {blocker.stat().st_mode & 0o777:o}; choose a "
                "--dir under /var/lib or /srv, or pass --state postgresql://... of a running "
                "server",
                str(directory),
            )
