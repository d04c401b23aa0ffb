"""A minimal QMP client: QEMU's JSON control protocol on a unix socket.

One command at a time, each with its own id: asynchronous events QEMU
sends in between, and any reply that is not to this command (seen once in
CI: query-status answered with an earlier command's empty return), are
skipped. Only what snapshots and the display need: status, stop/cont,
migrate to and from a file, input events, screendump, quit.

Every wait is bounded. A QEMU whose main loop is stuck (loading a damaged
state, a wedged device) still accepts connections, since the kernel
queues them for its listening socket, and then never answers: without a
bound the caller (a create, a suspend, a whole node's event loop task)
would wait forever on it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral.errors import SandboxFailed

# Until the socket is there and greets: QEMU greets once its machine is
# up, which a loaded host may take a while to reach.
CONNECT_TIMEOUT = 30.0
# No command Corral sends makes QEMU's main loop busy for long: migrate
# returns at once and is polled. A minute covers a loaded 2-core host
# running TCG guests, whose vCPU threads contend for QEMU's big lock.
REPLY_TIMEOUT = 60.0


class Qmp:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        path: Path,
        reply_timeout: float | None = None,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.path = path
        self.reply_timeout = REPLY_TIMEOUT if reply_timeout is None else reply_timeout
        self._next_id = 0

    @classmethod
    async def connect(
        cls, path: Path, timeout: float | None = None, reply_timeout: float | None = None
    ) -> Qmp:
        """`timeout` bounds the wait for the socket and its greeting;
        `reply_timeout` each command's answer after that."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (CONNECT_TIMEOUT if timeout is None else timeout)
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 24)
                break
            except OSError:
                if loop.time() > deadline:
                    raise SandboxFailed(f"QEMU's control socket {path} never answered") from None
                await asyncio.sleep(0.02)
        qmp = cls(reader, writer, path, reply_timeout)
        try:
            await qmp._answer(
                "its greeting", lambda doc: "QMP" in doc, max(deadline - loop.time(), 1.0)
            )
            await qmp.execute("qmp_capabilities")
        except BaseException:
            qmp.close()
            raise
        return qmp

    async def _answer(
        self, awaited: str, wanted: Callable[[dict[str, Any]], bool], timeout: float
    ) -> dict[str, Any]:
        """The first message `wanted` takes, skipping the rest. Events in
        between count against the same bound: a stream of them must not
        keep the caller waiting past it."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    line = await self.reader.readline()
                    if not line:
                        raise SandboxFailed("QEMU closed its control socket")
                    doc: dict[str, Any] = json.loads(line)
                    if wanted(doc):
                        return doc
        except TimeoutError:
            raise SandboxFailed(
                f"QEMU's control socket {self.path} gave no answer to {awaited} in {timeout:g} s"
            ) from None

    async def execute(self, command: str, **arguments: Any) -> Any:
        self._next_id += 1
        msg: dict[str, Any] = {"execute": command, "id": self._next_id}
        if arguments:
            msg["arguments"] = arguments
        self.writer.write(json.dumps(msg).encode() + b"\n")
        doc = await self._answer(
            command,
            lambda doc: "event" not in doc and doc.get("id") == msg["id"],
            self.reply_timeout,
        )
        if "error" in doc:
            raise SandboxFailed(f"QEMU refused {command}: {doc['error'].get('desc')}")
        return doc.get("return")

    async def status(self) -> str:
        return str((await self.execute("query-status"))["status"])

    def close(self) -> None:
        self.writer.close()
