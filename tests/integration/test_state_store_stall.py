"""A node's heartbeat against a state store that stops answering: a
real PostgreSQL behind a TCP relay that, on cue, keeps its connections
open and passes nothing (a stalled server, or a half-open connection the
kernel has not noticed yet). The beat fails in bounded time, and once the
store answers again the next beats land on fresh connections; before, one
beat waited for ever and the gateways wrote a healthy node off."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest

from corral.capacity import NodeCapacity
from corral.control import heartbeat, nodes, schema
from corral.control.heartbeat import Heartbeat
from corral.control.postgres import LocalPostgres
from corral.db import connect
from corral.node.agent import NodeAgent

from ..framework.processes import free_port

pytestmark = pytest.mark.integration


class Relay:
    """127.0.0.1:port -> PostgreSQL; `stalled` drops what either side sends
    while keeping every connection open."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.stalled = threading.Event()
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        self.server.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self.server.accept()
            except TimeoutError:
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self._socks += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                t = threading.Thread(target=self._pipe, args=(a, b), daemon=True)
                t.start()
                self._threads.append(t)

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        src.settimeout(0.2)
        while not self._stop.is_set():
            try:
                data = src.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            if not self.stalled.is_set():
                with contextlib.suppress(OSError):
                    dst.sendall(data)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        for s in [self.server, *self._socks]:
            s.close()


@dataclass
class _Config:
    node: str


class _Agent:
    """What a heartbeat reads of its node agent: its name and capacity."""

    def __init__(self) -> None:
        self.config = _Config("stall-node")

    def capacity(self) -> NodeCapacity:
        return NodeCapacity(max_sandboxes=4, kinds=("container",))


@pytest.fixture
def postgres(data_root: Path) -> Iterator[LocalPostgres]:
    """Under the session's data root: PostgreSQL runs as its own user,
    which cannot reach pytest's private tmp_path."""
    root = data_root / "stall-pg"
    pg = LocalPostgres(root, port=free_port())
    pg.start()
    try:
        yield pg
    finally:
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


async def test_a_stalled_store_fails_a_beat_in_bounded_time_and_the_node_beats_again(
    postgres: LocalPostgres, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(heartbeat, "BEAT_TIMEOUT", 1.0)
    direct = await connect(postgres.url)
    await schema.migrate(direct)
    relay = Relay(postgres.port)
    db = await connect(postgres.url.replace(f":{postgres.port}/", f":{relay.port}/"))
    beat = Heartbeat(cast(NodeAgent, _Agent()), db, "http://stall-node", interval=0.2)
    try:
        await beat.beat()
        relay.stalled.set()
        began = time.monotonic()
        with pytest.raises(TimeoutError, match="did not take the beat in 1 s"):
            await beat.beat()
        # The bound, then psycopg's own try to cancel the query (which the
        # stalled store does not answer either: ~10 s), then it is closed.
        assert time.monotonic() - began < 30
        relay.stalled.clear()
        # The stalled connection is not reused: the next beats land.
        async with asyncio.timeout(30):
            while True:
                with contextlib.suppress(TimeoutError):
                    await beat.beat()
                    break
        [row] = [n for n in await nodes.list_nodes(direct) if n.name == "stall-node"]
        assert row.state == nodes.ALIVE
    finally:
        await db.aclose()
        await direct.aclose()
        relay.close()
