"""The Ray actors of a cluster: one node agent per Ray node, and gateways.

Each actor runs the ordinary server (corral.server) on a thread of its own
with its own event loop. Ray only places it (pinned to its node), names it
(`corral-node-<node>` in namespace `corral`, so `cluster up` is idempotent)
and restarts it when its process dies; requests never pass through Ray.
A restarted node agent recovers its sandboxes from its data dir, as after
any crash (node/maintenance.py).

The classes are plain: cluster/up.py wraps them with ``ray.remote`` so that
importing this module needs no Ray.
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from corral.config import NodeConfig

NAMESPACE = "corral"


@dataclass(frozen=True)
class NodeSpec:
    node: str
    data_dir: str
    host: str
    port: int
    state: str
    node_key: str
    images: str | None = None
    network_pool: str = "10.200.0.0/16"
    dns_port: int = 10053
    image_sources: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    # The cluster's own hosts (cluster/up.py control_plane): no sandbox
    # reaches them, whatever private range its policy names.
    deny: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def config(self) -> NodeConfig:
        """The node's config, as its actor and `cluster down`'s cleaning run it."""
        from corral.config import NodeConfig

        # Its creates are tenants': registry pulls guarded (images/egress.py)
        # unless CORRAL_PULL_GUARD says otherwise.
        guard = {} if "CORRAL_PULL_GUARD" in os.environ else {"pull_guard": True}
        cfg = NodeConfig.from_env(
            data_dir=Path(self.data_dir),
            node=self.node,
            images=Path(self.images) if self.images else None,
            network_pool=self.network_pool,
            dns_port=self.dns_port,
            image_sources=list(self.image_sources),
            **guard,
        )
        # The cluster's own hosts, and what the operator denies besides.
        return replace(cfg, network_deny=[*cfg.network_deny, *self.deny])


@dataclass(frozen=True)
class GatewaySpec:
    host: str
    port: int
    state: str
    node_key: str
    node_timeout: float = 10.0
    burst: list[dict[str, Any]] = field(default_factory=list)  # control/burst.py
    burst_threshold: float = 0.8


class _Threaded:
    """Runs one coroutine on a private loop in a daemon thread."""

    def _launch(self, make: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._task: Future[None] = Future()
        self._thread = threading.Thread(target=self._main, args=(make,), daemon=True)
        self._thread.start()

    def _main(self, make: Any) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._main_task = self._loop.create_task(make())
            self._loop.run_until_complete(self._main_task)
            self._task.set_result(None)
        except BaseException as exc:
            self._task.set_exception(exc)

    def pid(self) -> int:
        return os.getpid()

    def alive(self) -> bool:
        return not self._task.done()

    def stop(self, timeout: float = 60.0) -> None:
        """End the server (as SIGTERM would): the node agent closes cleanly."""
        if not self._task.done():
            self._loop.call_soon_threadsafe(self._main_task.cancel)
        self._thread.join(timeout)


class NodeAgentActor(_Threaded):
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = NodeSpec(**spec)
        for k, v in self.spec.env.items():
            os.environ[k] = v
        self._launch(self._serve)

    async def _serve(self) -> None:
        from corral.server import serve

        s = self.spec
        await serve(
            s.config(),
            host=s.host,
            port=s.port,
            api_key=s.node_key,
            state=s.state,
            advertise=s.url,
            signals=False,
        )

    def info(self) -> dict[str, Any]:
        return {**asdict(self.spec), "pid": os.getpid(), "alive": self.alive()}


class GatewayActor(_Threaded):
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = GatewaySpec(**spec)
        self._launch(self._serve)

    async def _serve(self) -> None:
        from corral.server import serve_gateway

        s = self.spec
        await serve_gateway(
            s.state,
            host=s.host,
            port=s.port,
            node_key=s.node_key,
            node_timeout=s.node_timeout,
            burst=s.burst,
            burst_threshold=s.burst_threshold,
            signals=False,
        )

    def info(self) -> dict[str, Any]:
        return {**asdict(self.spec), "pid": os.getpid(), "alive": self.alive()}
