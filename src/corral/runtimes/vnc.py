"""A desktop's screen as an RFB byte stream, for the live view
(api/liveview.py bridges it to a browser).

A full VM's is a connection to QEMU's own VNC server (a root-only unix
socket in the sandbox's directory). A container desktop runs no server:
each view starts `x11vnc -inetd` in the sandbox, through its agent, and the
stream is that command's stdin and stdout. x11vnc wants one socket for
both directions, so a few lines of Perl (perl-base is in every Debian
image) give it one end of a socketpair and relay the other end to stdio.
The view's end closes stdin: the relay ends, and x11vnc with it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Protocol

from corral.execd import protocol as p
from corral.execd.client import ExecdClient, ExecSession

CHUNK = 1 << 16

# stdio <-> one end of a socketpair; x11vnc -inetd on the other.
RELAY = r"""
use strict; use Socket; use IO::Handle;
socketpair(my $mine, my $its, AF_UNIX, SOCK_STREAM, 0) or die "socketpair: $!";
my $pid = fork() // die "fork: $!";
if ($pid == 0) {
  close $mine;
  open(STDIN, "<&", $its) or die "stdin: $!"; open(STDOUT, ">&", $its) or die "stdout: $!";
  close $its;
  exec(@ARGV) or die "exec $ARGV[0]: $!";
}
close $its;
binmode STDIN; binmode STDOUT;
sub put { my ($fh, $d) = @_; while (length $d) {
  my $w = syswrite($fh, $d); return 0 unless defined $w; substr($d, 0, $w) = ""; } 1 }
my $rin = ""; vec($rin, fileno(STDIN), 1) = 1; vec($rin, fileno($mine), 1) = 1;
my $buf;
while (select(my $r = $rin, undef, undef, undef) > 0) {
  if (vec($r, fileno(STDIN), 1)) { last unless sysread(STDIN, $buf, 65536) && put($mine, $buf); }
  if (vec($r, fileno($mine), 1)) { last unless sysread($mine, $buf, 65536) && put(\*STDOUT, $buf); }
}
kill "TERM", $pid; waitpid($pid, 0);
"""
X11VNC = ["x11vnc", "-inetd", "-q", "-display", ":0", "-nopw", "-shared", "-noxdamage"]
ENV = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root"]


class ByteStream(Protocol):
    async def read(self, n: int) -> bytes:
        """Up to n bytes; b"" at the end."""
        ...

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def close(self) -> None: ...


class SocketStream:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, path: Path) -> SocketStream:
        return cls(*await asyncio.open_unix_connection(str(path)))

    async def read(self, n: int) -> bytes:
        return await self.reader.read(n)

    def write(self, data: bytes) -> None:
        self.writer.write(data)

    async def drain(self) -> None:
        await self.writer.drain()

    def close(self) -> None:
        self.writer.close()


class ExecStream:
    """A command's stdout (read) and stdin (write) in a sandbox."""

    def __init__(self, session: ExecSession) -> None:
        self.session = session
        self._events = session.events()
        self._pending: list[bytes] = []

    @classmethod
    async def x11vnc(cls, control: Path, seconds: float) -> ExecStream:
        session = await ExecdClient(str(control)).start(
            ["perl", "-e", RELAY, *X11VNC], ENV, user="root", cwd="/", timeout=seconds,
            stdout_cap=1 << 62, stderr_cap=1 << 16, stdin=None, stdin_open=True,
        )  # fmt: skip
        return cls(session)

    async def read(self, n: int) -> bytes:
        while True:
            try:
                kind, data = await anext(self._events)
            except StopAsyncIteration:
                return b""
            if kind == p.RSP_STDOUT and data:
                return data
            if kind == p.RSP_EXIT:
                return b""

    def write(self, data: bytes) -> None:
        self._pending.append(data)

    async def drain(self) -> None:
        data, self._pending = b"".join(self._pending), []
        if data:
            await self.session.send_stdin(data)

    def close(self) -> None:
        self.session.close()
