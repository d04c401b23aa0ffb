"""One node, as the tests see it (in the spirit of Firecracker's `Microvm`
test object): clients on it, embedded or over HTTP, the `corral serve`
process that serves it, its records, the aftermath of a crash forged on
it, and what it holds in the kernel and on disk.

The tests reach the node only through the public SDK, the `corral`
command line, the node agent's public surface (`NodeAgent.store`,
`.fncall`, ...) and what a node leaves on the host; nothing with a leading
underscore.
"""

from __future__ import annotations

import builtins
import subprocess
import weakref
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import corral
from corral.config import NodeConfig
from corral.errors import Unavailable
from corral.host import mounts
from corral.node.agent import NodeAgent
from corral.node.store import ACTIVE_STATES, SandboxRecord, Store

from . import leftovers as found
from .images import IMAGES
from .processes import CORRAL, Server, node_env


def agent_of(client: corral.AsyncClient) -> NodeAgent:
    """The node agent inside an embedded client (a started one)."""
    agent = client.service
    assert isinstance(agent, NodeAgent), f"{client.url}: not an embedded client"
    agent.parts  # noqa: B018 (raises Unavailable when it is not started)
    return agent


class Node:
    """A node on its own data dir. `server` is its `corral serve` process
    (not started until a test starts it); `client()` an embedded client,
    `http_client()` one through that server: both reach the same node."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        sock: Path | None = None,
        serve_env: dict[str, str] | None = None,
        serve_args: list[str] | None = None,
    ) -> None:
        self.config = config
        self.server = Server(
            config,
            sock or config.data_dir.parent / f"{config.node}.sock",
            env=serve_env,
            args=serve_args,
        )
        self._embedded: list[weakref.ref[corral.AsyncClient]] = []
        self._store: Store | None = None
        self._derived: list[Node] = []  # with_config()'s, closed with this one

    @property
    def name(self) -> str:
        return self.config.node

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        """The `corral serve` process (None before its first start)."""
        return self.server.proc

    def with_config(self, **changes: Any) -> Node:
        """The same node (data dir, name) run with other settings; closed
        with this one."""
        other = Node(
            replace(self.config, **changes),
            sock=self.server.sock,
            serve_env=dict(self.server.env),
            serve_args=list(self.server.args),
        )
        self._derived.append(other)
        return other

    # ---------------------------------------------------------------- clients

    def client(self) -> corral.AsyncClient:
        """An embedded client: a node agent in this process."""
        c = corral.AsyncClient(config=self.config)
        self._embedded.append(weakref.ref(c))
        return c

    def http_client(self, api_key: str | None = None, *, tcp: bool = False) -> corral.AsyncClient:
        """A client of the node's `corral serve` (its unix socket, or TCP)."""
        return corral.AsyncClient(self.server.tcp_url if tcp else self.server.url, api_key=api_key)

    @property
    def agent(self) -> NodeAgent:
        """The node agent of this node's one open embedded client."""
        open_ = []
        for ref in self._embedded:
            c = ref()
            if c is None:
                continue
            try:
                open_.append(agent_of(c))
            except Unavailable:
                continue  # not opened yet, or closed
        assert len(open_) == 1, (
            f"node {self.name}: {len(open_)} embedded clients are open; "
            "open one with `async with node.client()` (or use agent_of(client))"
        )
        return open_[0]

    def fncall_workers(self, image: str | None = None) -> int:
        """Function-call workers in the embedded agent's pool (of one image)."""
        stats = self.agent.fncall.pool.stats()
        if image is not None:
            return stats.get(image, {}).get("workers", 0)
        return sum(s["workers"] for s in stats.values())

    def cli(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """`corral --data-dir <this node> ARGS`, as a user runs it."""
        proc = subprocess.run(
            [*CORRAL, "--data-dir", str(self.config.data_dir), *args],
            capture_output=True,
            text=True,
            env=node_env(self.config),
            timeout=timeout,
            input=input,
        )
        if check:
            assert proc.returncode == 0, proc.stderr
        return proc

    # ---------------------------------------------------------------- records

    @property
    def store(self) -> Store:
        """The node's records, on a connection of the harness's own (as
        another process of the node reads them: whether an agent runs here,
        in `corral serve`, or none does)."""
        if self._store is None:
            self._store = Store(self.config.db_path)
        return self._store

    def records(
        self, states: Iterable[str] = ACTIVE_STATES, labels: dict[str, str] | None = None
    ) -> builtins.list[SandboxRecord]:
        return self.store.list(states, labels)

    def record(self, sandbox_id: str) -> SandboxRecord | None:
        return self.store.get(sandbox_id)

    def resources(self, sandbox_id: str) -> builtins.list[tuple[str, str]]:
        """(kind, ref) of what the record says a sandbox holds."""
        return self.store.resources(sandbox_id)

    def idmap_slot(self, sandbox_id: str) -> int | None:
        """The block of host ids a sandbox's user namespace maps onto."""
        return self.store.idmap_slot(sandbox_id)

    def forget(self, sandbox_id: str) -> builtins.list[tuple[str, str]]:
        """Forge a crash's aftermath: the node loses its record of a sandbox
        and of what it holds, while the sandbox's processes, mounts,
        cgroups and subvolume stay. Returns what the record said it held."""
        store = self.store
        held = store.resources(sandbox_id)
        assert store.get(sandbox_id) is not None, f"no record of {sandbox_id} to forget"
        with store.transaction() as db:
            db.execute("DELETE FROM resources WHERE sandbox_id=?", (sandbox_id,))
            db.execute("DELETE FROM sandboxes WHERE id=?", (sandbox_id,))
        return held

    # ---------------------------------------------------------------- what it holds

    def leftovers(self) -> dict[str, int]:
        """What the node holds, found on the host; {} when it holds nothing."""
        return found.leftovers(self.config)

    def init_processes(self) -> builtins.list[int]:
        """Pids of the sandboxes' init processes (alive with or without an agent)."""
        return found.init_processes(self.config)

    def qemu_processes(self, sandbox_id: str | None = None) -> builtins.list[int]:
        """Pids of the node's QEMU processes (of one sandbox, if given)."""
        return found.qemu_processes(self.config, sandbox_id)

    def mounts(self) -> builtins.list[tuple[str, str, str]]:
        """Every mount under the node's data dir (mount point, fs, source)."""
        return mounts.mounts_under(self.config.data_dir)

    def close(self) -> None:
        """Stop the server if it runs; close the harness's connection."""
        for other in self._derived:
            other.close()
        self.server.stop()
        if self._store is not None:
            self._store.close()
            self._store = None


async def close_everything(root: Path) -> None:
    """Close every sandbox of every node under root (after a failed test)."""
    for db in root.glob("*/state.db"):
        name = (db.parent / "node").read_text().strip()
        images = db.parent / "images" if (db.parent / "images").exists() else IMAGES
        cfg = NodeConfig.from_env(data_dir=db.parent, node=name, images=images)
        async with corral.AsyncClient(config=cfg) as c:
            for s in await c.sandboxes.list():
                await s.close()
