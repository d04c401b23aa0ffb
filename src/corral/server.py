"""`corral serve`: a node agent behind the HTTP API, in one process."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import os
import signal
from collections.abc import Iterator
from typing import Any

import uvicorn

from corral import trace
from corral.api.app import create_app
from corral.api.h2c import H2cOrHttp11
from corral.api.liveview import add_live_view
from corral.api.liveviewproxy import add_live_view_proxy
from corral.config import NodeConfig, e2b_templates
from corral.dashboard import add_dashboard
from corral.errors import InvalidArgument, NotFound
from corral.images.blobd import create_blob_app
from corral.log import configure, get_logger
from corral.node.agent import NodeAgent

log = get_logger("corral.server")
PR_SET_CHILD_SUBREAPER = 36
NODE_BLOBS = ("blobs/", "layers/", "tags/")  # what of a node's layer store its peers read


def become_subreaper() -> None:
    """Containers' init processes re-parent to us when crun exits, instead
    of to the host's PID 1 (which may reap them late): we reap them."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


class _Server(uvicorn.Server):
    """uvicorn re-raises SIGTERM after shutting down, which would kill us
    before the agent closes; signals are handled by serve() instead."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _run(
    app: Any, *, host: str, port: int, socket: str | None = None, signals: bool = True
) -> None:
    """Serve `app` on host:port (and a unix socket) until SIGTERM/SIGINT,
    or until cancelled when `signals` is off (inside a Ray actor, whose
    signals are Ray's)."""
    configs = [dict(host=host, port=port)] + ([dict(uds=socket)] if socket else [])
    servers = [
        _Server(
            uvicorn.Config(
                app,
                log_level="warning",
                access_log=False,
                lifespan="off",
                http=H2cOrHttp11,
                **cfg,  # type: ignore[arg-type]
            )
        )
        for cfg in configs
    ]

    def stop() -> None:
        for s in servers:
            s.should_exit = True

    if signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
    try:
        await asyncio.gather(*(s.serve() for s in servers))
    finally:
        stop()
        if socket:
            # uvicorn leaves the path behind; a stale one misleads whoever
            # looks for a server there (and holds a run tmpfs: host/runfs.py).
            with contextlib.suppress(OSError):
                os.unlink(socket)


def require_key_beyond_loopback(host: str, key: str | None, flag: str) -> None:
    """Whoever can reach an unkeyed server runs code as its sandboxes and
    reads its files: without a key it listens on loopback only."""
    if key:
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise InvalidArgument(
            "host", f"may be beyond loopback only with an API key: give {flag}", host
        )


async def serve(
    config: NodeConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 7070,
    socket: str | None = None,
    api_key: str | None = None,
    log_level: str = "info",
    state: str | None = None,
    advertise: str | None = None,
    signals: bool = True,
) -> None:
    """A node agent behind the HTTP API. With `state` (a cluster's state
    store), it also heartbeats its capacity there as reachable at
    `advertise` (default http://host:port), so gateways place on it."""
    configure(log_level)
    # OTLP traces, if configured (config, else OTEL_EXPORTER_OTLP_*): docs/tracing.md.
    trace.configure("corral-node", config.otlp_endpoint)
    key = api_key or os.environ.get("CORRAL_API_KEY")
    require_key_beyond_loopback(host, key, "--api-key (or CORRAL_API_KEY)")
    become_subreaper()
    agent = NodeAgent(config, reap_children=True)
    await agent.start()
    warming = asyncio.create_task(_warm(agent)) if config.fncall_warm else None
    app = create_app(
        agent, api_key=key, e2b_templates=config.e2b_templates, node=config.node,
        loopback_only=key is None,
    )  # fmt: skip
    add_dashboard(app, app.state.resolve, agent=agent)  # /ui, behind the same key
    # /view/<token>: a desktop's live view (the token is its own key).
    agent.parts.displays.served = True
    add_live_view(app, agent.parts.displays.open_view)
    # The node's layer store, readable by other nodes (image pull, lazy
    # loading): its layers only, and read only (a peer holding the nodes'
    # key must not rewrite what this node mounts).
    create_blob_app(config.images_dir, api_key=key, app=app, prefix="/blobs", serves=NODE_BLOBS)
    beat = None
    db = None
    try:
        if state is not None:
            from corral.control.heartbeat import Heartbeat
            from corral.control.schema import migrate
            from corral.db import connect

            db = await connect(state)
            await migrate(db)
            beat = Heartbeat(agent, db, advertise or f"http://{host}:{port}")
        log.info("server.listening", host=host, port=port, socket=socket, node=config.node)
        server = asyncio.create_task(
            _run(app, host=host, port=port, socket=socket, signals=signals)
        )
        if beat is not None:
            await _until_listening(host, port, server)
            await beat.start()
        await server
    finally:
        if warming is not None:
            warming.cancel()
        if beat is not None:
            await beat.stop(leave=False)
        if db is not None:
            await db.aclose()
        await agent.aclose()
        trace.shutdown()  # what is batched is sent before the process goes
        log.info("server.stopped")


async def _until_listening(host: str, port: int, server: asyncio.Task[None]) -> None:
    """A node is announced only once it answers: a gateway may place on it
    the moment its heartbeat lands."""
    for _ in range(500):
        if server.done():
            await server  # re-raises why it could not start
        try:
            _, writer = await asyncio.open_connection(host, port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.02)
    raise OSError(f"the server did not start listening on {host}:{port}")


async def serve_gateway(
    state: str,
    *,
    host: str = "127.0.0.1",
    port: int = 7070,
    node_key: str | None = None,
    node_timeout: float = 10.0,
    burst: list[dict[str, Any]] | None = None,
    burst_threshold: float = 0.8,
    log_level: str = "info",
    signals: bool = True,
) -> None:
    """A gateway replica: the same API, placing on and routing to the node
    agents that heartbeat into `state`. Callers authenticate with a
    project's API key; nodes are reached with `node_key`; `burst` names
    other clusters to spill to (control/burst.py)."""
    from corral.control.burst import Targets, parse_targets
    from corral.control.gateway import Gateway
    from corral.db import connect

    targets = Targets(parse_targets(burst or []), burst_threshold)  # checked before anything
    configure(log_level)
    trace.configure("corral-gateway")
    db = await connect(state)
    close_views = None
    gateway = Gateway(
        db, node_key=node_key or os.environ.get("CORRAL_NODE_KEY"), node_timeout=node_timeout,
        burst=targets,
    )  # fmt: skip
    try:
        await gateway.start()
        app = create_app(
            None, for_token=gateway.for_token, for_sandbox=gateway.for_sandbox,
            e2b_templates=e2b_templates(), operator=gateway.is_operator,
        )  # fmt: skip
        add_dashboard(app, app.state.resolve, gateway=gateway)

        async def node_url(name: str) -> str:
            node = await gateway.node(name)
            if node is None:
                raise NotFound(f"no node {name} in this cluster (the view token names it)")
            return node.url

        # /view/<token>: a desktop's live view, relayed to its node.
        close_views = add_live_view_proxy(app, node_url)
        log.info("gateway.listening", host=host, port=port)
        await _run(app, host=host, port=port, signals=signals)
    finally:
        if close_views is not None:
            await close_views()
        await gateway.aclose()
        await db.aclose()
        trace.shutdown()
        log.info("gateway.stopped")


async def _warm(agent: NodeAgent) -> None:
    """Start function-call workers ahead of the first calls."""
    cfg = agent.config
    try:
        await agent.fncall.pool.warm(cfg.fncall_worker, cfg.fncall_warm)
        log.info("fncall.warm", image=cfg.fncall_worker, workers=cfg.fncall_warm)
    except Exception as exc:
        log.error("fncall.warm_failed", image=cfg.fncall_worker, error=str(exc))
