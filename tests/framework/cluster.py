"""A cluster of processes on this machine: a PostgreSQL of its own, node
agents (`corral serve --state`, each a Node with its own data dir, cgroup
subtree, address pool and DNS port) and a gateway. What the cluster tests
and bench/cluster.py run; `corral cluster up` runs the same parts under Ray."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import corral
from corral.config import NodeConfig
from corral.control import keys, nodes, quotas
from corral.control.postgres import LocalPostgres
from corral.db import Database, connect

from .images import IMAGES
from .node import Node
from .processes import GatewayProcess, free_port, run_sync


class Cluster:
    NODE_KEY = "nk-" + "0" * 8  # the nodes' own key: not a project key

    def __init__(
        self,
        root: Path,
        nodes: int = 3,
        node_timeout: float = 3.0,
        *,
        prefix: str = "k",
        net_offset: int = 0,
        node_config: dict[str, Any] | None = None,
        gateway_args: list[str] | None = None,
    ) -> None:
        """`prefix` names the nodes (k0, k1 ...); `net_offset` moves their
        address pools and DNS ports, so two clusters can share the machine;
        `node_config` overrides NodeConfig fields (images=None: each node
        its own, empty store)."""
        self.root = root
        self.gateway_args = list(gateway_args or [])
        self.node_timeout = node_timeout
        self.pg = LocalPostgres(root / "pg", port=free_port())
        self.nodes: list[Node] = []
        for i in range(nodes):
            name = f"{prefix}{i}"
            settings: dict[str, Any] = {
                "images": IMAGES, "scratch_size": 16 * 2**30, "reaper_interval": 0.5,
                **(node_config or {}),
            }  # fmt: skip
            cfg = replace(NodeConfig.from_env(data_dir=root / name, node=name), **settings)
            j = i + net_offset
            env = {
                "CORRAL_API_KEY": self.NODE_KEY,
                "CORRAL_NETWORK_POOL": f"10.{210 + j}.0.0/16",
                "CORRAL_DNS_PORT": str(10253 + j),
            }
            for k, v in (node_config or {}).items():
                if k != "images":  # node_env names the store
                    env[f"CORRAL_{k.upper()}"] = (
                        json.dumps(v) if isinstance(v, list | dict) else str(v)
                    )
            self.nodes.append(Node(cfg, sock=root / f"{name}.sock", serve_env=env))
        self.state = ""
        self.gateway: GatewayProcess | None = None

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def start(self, only: list[str] | None = None) -> None:
        """PostgreSQL, the nodes (those named in `only`: the rest may join
        later) and the gateway."""
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)  # PostgreSQL runs as its own user
        self.state = self.pg.start()
        for n in self.nodes:
            n.server.args = ["--state", self.state, "--advertise", n.server.tcp_url]
            if only is None or n.name in only:
                n.server.start()
        self.wait_alive([n.name for n in self.nodes if n.server.running])
        self.gateway = GatewayProcess(
            self.state, self.NODE_KEY, self.node_timeout, self.root / "gateway.log",
            self.gateway_args,
        )  # fmt: skip
        self.gateway.start()

    def stop(self) -> None:
        if self.gateway is not None:
            self.gateway.kill(signal.SIGTERM)
        for n in self.nodes:
            if n.server.running:
                n.server.send(signal.SIGCONT)  # a test may have left one stopped
                run_sync(_close_all(self.node_client(n)))
            n.close()
        self.pg.stop()

    # ---------------------------------------------------------------- clients

    def client(self, key: str, **kw: Any) -> corral.AsyncClient:
        """A client of the gateway, with a project's key."""
        assert self.gateway is not None
        return corral.AsyncClient(self.gateway.url, api_key=key, **kw)

    def node_client(self, node: Node, *, tcp: bool = False) -> corral.AsyncClient:
        """Straight to a node agent, past the gateway (on its unix socket,
        or on TCP as the gateway reaches it)."""
        return node.http_client(self.NODE_KEY, tcp=tcp)

    async def held(self, node: Node) -> list[str]:
        """Ids of the gateway's sandboxes a node holds (asked of the node)."""
        async with self.node_client(node) as c:
            return [s.id for s in await c.sandboxes.list() if "corral.key" in s.info.labels]

    async def held_everywhere(self) -> list[str]:
        held: list[str] = []
        for n in self.nodes:
            held += await self.held(n)
        return sorted(held)

    # ---------------------------------------------------------------- the control plane's state

    async def db(self) -> Database:
        return await connect(self.state)

    def node_states(self) -> dict[str, str]:
        async def go() -> dict[str, str]:
            db = await self.db()
            try:
                return {n.name: n.state for n in await nodes.list_nodes(db)}
            finally:
                await db.aclose()

        return run_sync(go())

    def join(self, node: Node) -> None:
        """Start a node that start() left out (or that was stopped)."""
        node.server.start()
        self.wait_alive([node.name])

    def wait_alive(self, names: list[str], timeout: float = 30, state: str = "alive") -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = self.node_states()
            if all(states.get(n) == state for n in names):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"nodes did not join: {states}")
            time.sleep(0.1)

    def project(self, name: str, parent: str | None = None, **limits: Any) -> str:
        """Create a project; returns an API key of it."""
        return make_project(self.state, name, parent, **limits)

    def used(self, name: str) -> tuple[int, float, int]:
        """(sandboxes, cpu, memory) a project is charged for."""

        async def go() -> tuple[int, float, int]:
            db = await self.db()
            try:
                p = await quotas.get_project(db, name)
                return p.used_sandboxes, p.used_cpu, p.used_memory
            finally:
                await db.aclose()

        return run_sync(go())

    def rows(self) -> dict[str, int]:
        """Sandbox rows by state."""

        async def go() -> dict[str, int]:
            db = await self.db()
            try:
                async with db.transaction() as tx:
                    found = await tx.fetchall(
                        "SELECT state, COUNT(*) FROM sandboxes GROUP BY state"
                    )
                return {str(s): int(n) for s, n in found}
            finally:
                await db.aclose()

        return run_sync(go())


def make_project(state: str, name: str, parent: str | None = None, **limits: Any) -> str:
    """Create a project in the state store at `state`; returns an API key of it."""

    async def go() -> str:
        db = await connect(state)
        try:
            await quotas.create_project(db, name, parent=parent, **limits)
            key, _ = await keys.create_key(db, name)
            return key
        finally:
            await db.aclose()

    return run_sync(go())


async def _close_all(client: corral.AsyncClient) -> None:
    async with client as c:
        for s in await c.sandboxes.list():
            try:
                await s.close()
            except corral.CorralError:
                pass  # fncall workers are the node's own
