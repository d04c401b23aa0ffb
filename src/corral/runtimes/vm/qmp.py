"""A minimal QMP client: QEMU's JSON control protocol on a unix socket.

One command at a time, each with its own id: asynchronous events QEMU
sends in between, and any reply that is not to this command (seen once in
CI: query-status answered with an earlier command's empty return), are
skipped. Only what snapshots need: status, stop/cont, migrate to and from
a file, quit.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from corral.errors import SandboxFailed


class Qmp:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self._next_id = 0

    @classmethod
    async def connect(cls, path: Path, timeout: float = 30.0) -> Qmp:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(path), limit=1 << 24)
                break
            except OSError:
                if loop.time() > deadline:
                    raise SandboxFailed(f"QEMU's control socket {path} never answered") from None
                await asyncio.sleep(0.02)
        qmp = cls(reader, writer)
        await qmp._read()  # the greeting
        await qmp.execute("qmp_capabilities")
        return qmp

    async def _read(self) -> dict[str, Any]:
        line = await self.reader.readline()
        if not line:
            raise SandboxFailed("QEMU closed its control socket")
        doc: dict[str, Any] = json.loads(line)
        return doc

    async def execute(self, command: str, **arguments: Any) -> Any:
        self._next_id += 1
        msg: dict[str, Any] = {"execute": command, "id": self._next_id}
        if arguments:
            msg["arguments"] = arguments
        self.writer.write(json.dumps(msg).encode() + b"\n")
        await self.writer.drain()
        while True:
            doc = await self._read()
            if "event" in doc or doc.get("id") != msg["id"]:
                continue
            if "error" in doc:
                raise SandboxFailed(f"QEMU refused {command}: {doc['error'].get('desc')}")
            return doc.get("return")

    async def status(self) -> str:
        return str((await self.execute("query-status"))["status"])

    def close(self) -> None:
        self.writer.close()
