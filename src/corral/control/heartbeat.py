"""A node agent's heartbeat: its capacity, written to the state store.

Ray supervises node agents but is never asked where they are or how full:
the state store is the one membership list gateways read. A failed beat
(the store restarting) is logged and retried at the next interval; the
gateways' sweep judges silence only on a store it has reached without a
break for a full timeout, so a store outage does not write nodes off.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from corral.control import nodes
from corral.db import Database
from corral.log import get_logger
from corral.node.agent import NodeAgent

log = get_logger("corral.heartbeat")

BEAT_TIMEOUT = 5.0  # at least; 3 intervals where those are longer


class Heartbeat:
    def __init__(self, agent: NodeAgent, db: Database, url: str, interval: float = 1.0) -> None:
        self.agent = agent
        self.db = db
        self.url = url
        self.interval = interval
        self._task: asyncio.Task[None] | None = None

    async def beat(self) -> None:
        """One beat, bounded: a store that takes the query and never
        answers (stalled, or a half-open connection the kernel has not
        noticed yet) fails this beat, and the next one takes another
        connection, instead of silencing the node until the gateways
        write it off."""
        bound = max(BEAT_TIMEOUT, 3 * self.interval)
        try:
            async with asyncio.timeout(bound):
                before = await nodes.heartbeat(
                    self.db, self.agent.config.node, self.url, self.agent.capacity()
                )
        except TimeoutError:
            raise TimeoutError(f"the state store did not take the beat in {bound:g} s") from None
        if before != nodes.ALIVE:
            log.info("node.joined", node=self.agent.config.node, url=self.url, was=before)

    async def start(self) -> None:
        await self.beat()  # registered before the server reports ready
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        failing = False
        last = time.monotonic()
        while True:
            await asyncio.sleep(self.interval)
            try:
                t0 = time.monotonic()
                await self.beat()
                now = time.monotonic()
                if now - last > 2 * self.interval:
                    # Gateways write a node off after their node timeout of
                    # silence: a late beat says how close this one came.
                    log.warning(
                        "heartbeat.late",
                        node=self.agent.config.node,
                        since_last_s=round(now - last, 2),
                        beat_s=round(now - t0, 2),
                    )
                last = now
                if failing:
                    log.info("heartbeat.recovered", node=self.agent.config.node)
                failing = False
            except Exception as exc:
                if not failing:
                    log.warning("heartbeat.failed", node=self.agent.config.node, error=str(exc))
                failing = True

    async def stop(self, *, leave: bool) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if leave:
            with contextlib.suppress(Exception):
                await nodes.leave(self.db, self.agent.config.node)
