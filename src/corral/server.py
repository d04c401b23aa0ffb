"""`corral serve`: a node agent behind the HTTP API, in one process."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
from collections.abc import Iterator

import uvicorn

from corral.api.app import create_app
from corral.config import NodeConfig
from corral.images.blobd import create_blob_app
from corral.log import configure, get_logger
from corral.node.agent import NodeAgent

log = get_logger("corral.server")
PR_SET_CHILD_SUBREAPER = 36


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


async def serve(
    config: NodeConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 7070,
    socket: str | None = None,
    api_key: str | None = None,
    log_level: str = "info",
) -> None:
    configure(log_level)
    become_subreaper()
    agent = NodeAgent(config, reap_children=True)
    await agent.start()
    warming = asyncio.create_task(_warm(agent)) if config.fncall_warm else None
    key = api_key or os.environ.get("CORRAL_API_KEY")
    app = create_app(agent, api_key=key)
    # The node's layer store, readable by other nodes (image pull, lazy loading).
    create_blob_app(config.images_dir, api_key=key, app=app, prefix="/blobs")
    servers = [
        _Server(
            uvicorn.Config(
                app, host=host, port=port, log_level="warning", access_log=False, lifespan="off"
            )
        )
    ]
    if socket:
        servers.append(
            _Server(
                uvicorn.Config(
                    app, uds=socket, log_level="warning", access_log=False, lifespan="off"
                )
            )
        )

    def stop() -> None:
        for s in servers:
            s.should_exit = True

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    log.info("server.listening", host=host, port=port, socket=socket, node=config.node)
    try:
        await asyncio.gather(*(s.serve() for s in servers))
    finally:
        if warming is not None:
            warming.cancel()
        await agent.aclose()
        log.info("server.stopped")


async def _warm(agent: NodeAgent) -> None:
    """Start function-call workers ahead of the first calls."""
    cfg = agent.config
    try:
        await agent.fncall.pool.warm(cfg.fncall_image, cfg.fncall_warm)
        log.info("fncall.warm", image=cfg.fncall_image, workers=cfg.fncall_warm)
    except Exception as exc:
        log.error("fncall.warm_failed", image=cfg.fncall_image, error=str(exc))
