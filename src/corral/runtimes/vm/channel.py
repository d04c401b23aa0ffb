"""The host end of a VM guest agent's channel.

A guest has one byte stream to its agent (a virtio-serial port, reached on
the host through QEMU's chardev socket), while the exec client opens one
connection per request. This multiplexer listens on the sandbox's control
path, exactly where a container's exec server listens, and carries each
accepted connection as a stream of the same frames tagged with a stream id;
corral-init's `--serial` mode does the reverse in the guest. So ExecdClient,
and everything built on it (commands, files, readiness), works unchanged.

Invariants: a frame is forwarded whole, with only its stream id rewritten;
no host client can hold the port for longer than SLOW_CLIENT_TIMEOUT;
every stream the host opens it also closes toward the guest, exactly once,
whichever side ended it first (the guest holds a descriptor per stream until
then); stream ids are never reused within one channel, and a channel's first frame
on a port resets the guest's streams (stream 0 closed); when the port goes away
(QEMU exits, the guest reboots) every open stream is ended, never silently
re-attached to a different guest.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Awaitable, Callable
from pathlib import Path

from corral.execd import protocol as p
from corral.log import get_logger

log = get_logger("corral.vm.channel")

Port = tuple[asyncio.StreamReader, asyncio.StreamWriter]

# What one host client may leave unread before the port waits for it, and
# how long it then waits: past that the client's stream is ended. The
# guest's liveness answers come through the same port, and a VM silent
# for vm_hang_timeout (30 s) is failed.
STREAM_BACKLOG = 4 << 20
SLOW_CLIENT_TIMEOUT = 5.0


class AgentChannel:
    def __init__(self, control: Path, open_port: Callable[[], Awaitable[Port]]) -> None:
        self.control = control
        self.open_port = open_port
        self._ids = itertools.count(1)
        self._streams: dict[int, asyncio.StreamWriter] = {}
        self._port: asyncio.StreamWriter | None = None
        self._connected = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._pump: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.control.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(
            self._serve, path=str(self.control), limit=4 * p.MAX_PAYLOAD
        )
        self._pump = asyncio.create_task(self._run_port())

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        if self._pump is not None:
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        self._drop_streams()
        self.control.unlink(missing_ok=True)

    def _drop_streams(self) -> None:
        for writer in self._streams.values():
            writer.close()
        self._streams.clear()

    async def _run_port(self) -> None:
        while True:
            try:
                reader, writer = await self.open_port()
            except OSError:
                await asyncio.sleep(0.05)  # QEMU has not made its socket yet
                continue
            # Stream 0's close is a reset: the guest ends every stream it
            # still has. A resumed or forked guest kept the streams of the
            # host it was saved under, whose ids this channel reuses.
            writer.write(p.HEADER.pack(0, 0, p.FRAME_CLOSE))
            self._port = writer
            self._connected.set()
            try:
                await self._from_port(reader)
            except (asyncio.IncompleteReadError, OSError):
                pass  # QEMU exited, the guest went away: the port is gone
            finally:
                self._connected.clear()
                self._port = None
                writer.close()
                self._drop_streams()
            log.info("vm.channel.reconnecting", control=str(self.control))
            await asyncio.sleep(0.05)

    async def _from_port(self, reader: asyncio.StreamReader) -> None:
        while True:
            head = await reader.readexactly(p.HEADER.size)
            length, stream, kind = p.HEADER.unpack(head)
            if length > p.MAX_PAYLOAD:
                raise ConnectionError(f"guest sent a {length}-byte frame")
            payload = await reader.readexactly(length) if length else b""
            writer = self._streams.get(stream)
            if writer is None:
                continue  # a stream the host already ended
            if kind == p.FRAME_CLOSE:
                self._end(stream)
                continue
            try:
                writer.write(p.HEADER.pack(length, 0, kind) + payload)
                if writer.transport.get_write_buffer_size() > STREAM_BACKLOG:
                    # Waiting on one client holds up every stream of the
                    # port (head-of-line), the liveness pings included: a
                    # client that leaves this much unread for this long
                    # loses its stream, not the VM its life.
                    async with asyncio.timeout(SLOW_CLIENT_TIMEOUT):
                        await writer.drain()
            except TimeoutError:
                log.warning("vm.channel.slow_client", control=str(self.control), stream=stream,
                            backlog=writer.transport.get_write_buffer_size())  # fmt: skip
                self._end(stream)
            except ConnectionError:
                self._end(stream)  # that client left; the port is fine

    def _end(self, stream: int) -> None:
        """End a stream on both sides: its client's connection, and the
        guest's end (the guest frees a stream, and its descriptor, only once
        the host has closed it too; a stream it ended itself included)."""
        writer = self._streams.pop(stream, None)
        if writer is None:
            return
        writer.close()
        if self._port is not None:
            self._port.write(p.HEADER.pack(0, stream, p.FRAME_CLOSE))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One exec-client connection, as one stream."""
        try:
            async with asyncio.timeout(30):
                await self._connected.wait()
        except TimeoutError:
            writer.close()
            return
        stream = next(self._ids)
        self._streams[stream] = writer
        port = self._port
        try:
            while port is not None and self._port is port:
                head = await reader.readexactly(p.HEADER.size)
                length, _zero, kind = p.HEADER.unpack(head)
                payload = await reader.readexactly(length) if length else b""
                if stream not in self._streams:
                    break  # ended: the guest may have freed its id already
                port.write(p.HEADER.pack(length, stream, kind) + payload)
                await port.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        if port is not None and self._port is port:
            with contextlib.suppress(ConnectionError):
                self._end(stream)
                await port.drain()
