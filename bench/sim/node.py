"""Many simulated node agents in one process: what a gateway sees of a cell
without a single sandbox started.

    python bench/sim/node.py --state postgresql://... --nodes 160 --per-node 3200

Each simulated node is what a gateway knows of a node agent, and nothing
more: a row in the state store's `nodes` table, heartbeated every second
through the real `corral.control.nodes.heartbeat` with a live
`NodeCapacity`, and an HTTP endpoint answering the node API's create, get,
close and list (api/routes.py's paths, SandboxInfo replies, errors in the
wire shape of corral/errors.py). It checks the node key, honours
idempotency keys, mints ids with `corral.ids.new(node)`, refuses a create
with NodeFull (slots or memory) as a real node's admission does, and keeps
its counts so the next heartbeat reports them. A create takes
`--create-delay` seconds (a sleep: the node's boot time, not its CPU).

All nodes share one port: HttpService joins its paths onto its base URL's
path (httpx's base_url), so node n017 is advertised as
http://127.0.0.1:PORT/n017 and the first path segment picks the node. One
server for 160 nodes costs one process, not 160. `--first` lets several of
these processes split a cell between them, each on its own port.

`--full NAME,...`: those nodes refuse every create as full while their
heartbeats still advertise free slots: a node whose heartbeat is stale
(it filled up since), which placement picks and the node then refuses.

Run as a script by bench/cellsim.py and tests/integration/test_cellsim.py;
it is a measuring tool, not part of the installed package.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

import uvicorn

from corral import ids
from corral import labels as platform_labels
from corral.api.models import CreateSandbox, SandboxInfo, SandboxState, validated
from corral.capacity import NodeCapacity
from corral.control import nodes
from corral.control.schema import migrate
from corral.db import PostgresDatabase
from corral.errors import (
    CorralError,
    InvalidArgument,
    NodeFull,
    NotFound,
    SandboxNotFound,
    Unauthenticated,
)

GiB = 2**30
TiB = 2**40
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Reply = tuple[int, bytes]


@dataclass
class Box:
    """One simulated sandbox: its info as the node would send it."""

    info: SandboxInfo
    body: bytes
    held: bool  # made by a gateway (labelled corral.project): NodeCapacity.held
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def live(self) -> bool:
        return self.info.state != SandboxState.closed


@dataclass
class SimNode:
    name: str
    url: str
    max_sandboxes: int
    memory_budget: int
    cpus: int
    images: tuple[str, ...]
    create_delay: float
    refuse_all: bool = False
    boxes: dict[str, Box] = field(default_factory=dict)
    by_key: dict[str, str] = field(default_factory=dict)
    active: int = 0
    held: int = 0
    promised: int = 0
    calls: dict[str, int] = field(default_factory=dict)

    def capacity(self) -> NodeCapacity:
        # A refusing node reports itself empty: its heartbeat is the stale
        # view placement trusts until the node itself says "full".
        active, promised = (0, 0) if self.refuse_all else (self.active, self.promised)
        return NodeCapacity(
            max_sandboxes=self.max_sandboxes,
            active=active,
            held=self.held,
            memory_budget=self.memory_budget,
            memory_promised=promised,
            cpus=self.cpus,
            kinds=("container",),
            images=self.images,
        )

    def _count(self, op: str) -> None:
        self.calls[op] = self.calls.get(op, 0) + 1

    def _full(self, message: str, reason: str) -> NodeFull:
        self._count(f"full_{reason}")
        return NodeFull(message, node=self.name, reason=reason)

    async def create(self, body: bytes) -> Reply:
        self._count("create")
        try:
            doc = json.loads(body)
        except ValueError as exc:
            raise InvalidArgument("body", "must be JSON", str(exc)) from exc
        req = validated(CreateSandbox, doc)
        key = req.idempotency_key
        if key is not None and (earlier := self.by_key.get(key)) is not None:
            # The same key is the same sandbox, even on a node full since.
            self._count("create_again")
            box = self.boxes[earlier]
            await box.ready.wait()
            return 201, box.body
        if self.refuse_all or self.active >= self.max_sandboxes:
            raise self._full(
                f"node {self.name} is full: {self.active} sandboxes, "
                f"max_sandboxes is {self.max_sandboxes}",
                "slots",
            )
        if self.promised + req.memory > self.memory_budget:
            raise self._full(
                f"node {self.name} cannot promise {req.memory} more bytes of memory: "
                f"{self.promised} promised of {self.memory_budget}",
                "memory",
            )
        now = time.time()
        info = SandboxInfo(
            id=ids.new(self.name),
            node=self.name,
            kind=req.kind,
            state=SandboxState.creating,
            image=req.image,
            workspace=req.workspace,
            toolkit=req.toolkit,
            layers=[],
            cpu=req.cpu,
            memory=req.memory,
            disk=req.disk,
            pids=req.pids,
            ttl=req.ttl,
            idle_timeout=req.idle_timeout,
            env=req.env,
            labels=req.labels,
            created_at=now,
            expires_at=None if req.ttl is None else now + req.ttl,
            network=req.network,
        )
        # Admitted before the wait, as a real node records a sandbox before
        # booting it: concurrent creates see the slot taken.
        box = Box(info, info.model_dump_json().encode(), platform_labels.PROJECT in req.labels)
        self.boxes[info.id] = box
        if key is not None:
            self.by_key[key] = info.id
        self.active += 1
        self.promised += req.memory
        self.held += box.held
        try:
            if self.create_delay > 0:
                await asyncio.sleep(self.create_delay)
        finally:
            self._set_state(box, SandboxState.running)
            box.ready.set()
        return 201, box.body

    def _set_state(self, box: Box, state: SandboxState) -> None:
        box.info = box.info.model_copy(update={"state": state})
        box.body = box.info.model_dump_json().encode()

    def _box(self, sandbox_id: str) -> Box:
        box = self.boxes.get(sandbox_id)
        if box is None:
            raise SandboxNotFound(f"no sandbox {sandbox_id}", sandbox=sandbox_id)
        return box

    async def get(self, sandbox_id: str) -> Reply:
        self._count("get")
        return 200, self._box(sandbox_id).body

    async def close(self, sandbox_id: str) -> Reply:
        self._count("close")
        box = self._box(sandbox_id)
        await box.ready.wait()
        if box.live:
            self._set_state(box, SandboxState.closed)
            self.active -= 1
            self.promised -= box.info.memory
            self.held -= box.held
        return 204, b""

    async def list(self, query: str) -> Reply:
        self._count("list")
        wanted: dict[str, str] = {}
        for name, value in parse_qsl(query):
            if name == "label":
                k, _, v = value.partition("=")
                wanted[k] = v
        found = [
            b.body
            for b in self.boxes.values()
            if b.live and all(b.info.labels.get(k) == v for k, v in wanted.items())
        ]
        return 200, b'{"sandboxes":[' + b",".join(found) + b"]}"


class Cell:
    """The simulated nodes of this process, behind one ASGI app."""

    def __init__(self, sims: list[SimNode], node_key: str) -> None:
        self.nodes = {n.name: n for n in sims}
        self.node_key = node_key.encode()

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = bytes(value).removeprefix(b"Bearer ").strip()
                return hmac.compare_digest(given, self.node_key)
        return False

    async def _route(self, scope: Scope, body: bytes) -> Reply:
        method, path = scope["method"], scope["path"]
        if path == "/healthz":
            return 200, b'{"ok":true}'
        if not self._authorized(scope):
            raise Unauthenticated("a valid API key is required: Authorization: Bearer <key>")
        if path == "/_sim/stats" and method == "GET":
            return 200, json.dumps(self.stats()).encode()
        _, name, rest = (path + "/").split("/", 2)
        node = self.nodes.get(name)
        parts = rest.rstrip("/").split("/")
        if node is not None and parts[:2] == ["v1", "sandboxes"]:
            if len(parts) == 2 and method == "POST":
                return await node.create(body)
            if len(parts) == 2 and method == "GET":
                return await node.list(scope["query_string"].decode())
            if len(parts) == 3 and method == "GET":
                return await node.get(parts[2])
            if len(parts) == 3 and method == "DELETE":
                return await node.close(parts[2])
        raise NotFound(f"no endpoint {method} {path}")

    def stats(self) -> dict[str, Any]:
        return {
            n.name: {"active": n.active, "held": n.held, "calls": n.calls}
            for n in self.nodes.values()
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        try:
            status, out = await self._route(scope, b"".join(chunks))
        except CorralError as exc:
            status, out = exc.http_status, json.dumps({"error": exc.to_wire()}).encode()
        headers = [(b"content-length", str(len(out)).encode())]
        if out:
            headers.append((b"content-type", b"application/json"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": out})


class _Server(uvicorn.Server):
    """Signals are handled by main(), so that heartbeats stop and the
    pool closes before the process goes (uvicorn would re-raise SIGTERM)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _beat(db: PostgresDatabase, node: SimNode, interval: float, offset: float) -> None:
    await asyncio.sleep(offset)
    failing = False
    while True:
        try:
            await nodes.heartbeat(db, node.name, node.url, node.capacity())
            failing = False
        except Exception as exc:
            if not failing:
                print(f"simnode: heartbeat of {node.name} failed: {exc}", file=sys.stderr)
            failing = True
        await asyncio.sleep(interval)


async def run(args: argparse.Namespace) -> None:
    host_memory = int(args.memory_gib * GiB)
    full = set(filter(None, args.full.split(",")))
    sims = [
        SimNode(
            name=(name := f"{args.prefix}{i:03d}"),
            url=f"http://{args.host}:{args.port}/{name}",
            max_sandboxes=args.per_node,
            memory_budget=int(host_memory * args.overcommit),
            cpus=args.cpus,
            images=tuple(filter(None, args.images.split(","))),
            create_delay=args.create_delay,
            refuse_all=name in full,
        )
        for i in range(args.first, args.first + args.nodes)
    ]
    for n in sims:
        ids.check_node(n.name)
    cell = Cell(sims, args.node_key or os.environ.get("CORRAL_NODE_KEY", ""))
    server = _Server(
        uvicorn.Config(
            cell, host=args.host, port=args.port, log_level="warning", access_log=False,
            lifespan="off", backlog=4096,
        )
    )  # fmt: skip
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    db = PostgresDatabase(args.state, max_size=args.pool)
    await db.open()
    beats: list[asyncio.Task[None]] = []
    try:
        await migrate(db)
        serving = asyncio.create_task(server.serve())
        while not server.started:
            if serving.done():
                await serving  # why it could not start
                return
            await asyncio.sleep(0.02)
        # Announced only once answering, as a real node: a gateway may place
        # on a node the moment its first heartbeat lands.
        for n in sims:
            await nodes.heartbeat(db, n.name, n.url, n.capacity())
        beats = [
            asyncio.create_task(_beat(db, n, args.interval, args.interval * (i / len(sims))))
            for i, n in enumerate(sims)
        ]
        print(f"simnode: {len(sims)} nodes on port {args.port}", flush=True)
        await serving
    finally:
        for task in beats:
            task.cancel()
        await asyncio.gather(*beats, return_exceptions=True)
        await db.aclose()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--state", required=True, help="the cell's PostgreSQL URL")
    p.add_argument("--nodes", type=int, default=160)
    p.add_argument("--first", type=int, default=0, help="index of this process's first node")
    p.add_argument("--prefix", default="n", help="node names: PREFIX + 3-digit index")
    p.add_argument("--per-node", type=int, default=3200, help="max_sandboxes of each node")
    p.add_argument("--cpus", type=int, default=188, help="cores per node (30,000 / 160)")
    p.add_argument(
        "--memory-gib", type=float, default=1536, help="host memory per node (250 TB / 160)"
    )
    p.add_argument("--overcommit", type=float, default=8.0, help="memory_overcommit")
    p.add_argument("--images", default="debian-python:bookworm", help="images each node holds")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--node-key", help="the key nodes require (default $CORRAL_NODE_KEY)")
    p.add_argument("--create-delay", type=float, default=0.01, help="seconds a create takes")
    p.add_argument("--interval", type=float, default=1.0, help="heartbeat interval")
    p.add_argument("--pool", type=int, default=4, help="PostgreSQL connections")
    p.add_argument("--full", default="", help="nodes that refuse every create (stale heartbeat)")
    args = p.parse_args(argv)
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(run(args))


if __name__ == "__main__":
    main()
