"""`corral cluster up / down / status`: Corral on a Ray cluster.

up: start the state store (a local PostgreSQL unless --state names one),
start Ray (only with --local-nodes: N Ray nodes on this machine, for tests
and trials), then one detached node-agent actor per alive Ray node, pinned
to it, and a gateway actor on the head node. It returns once every node
heartbeats and the gateway answers; it writes <dir>/cluster.json (0600:
it holds the keys) for the SDK, `status` and `down`. Running it again
starts only what is missing.

down: close every sandbox on every node, stop the actors (the node agents
close cleanly: no mount, cgroup or process is left), and stop what `up`
started (the local Ray nodes, the local PostgreSQL).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from corral.cluster.actors import NAMESPACE, GatewaySpec, NodeSpec
from corral.control import nodes, quotas
from corral.control.postgres import LocalPostgres
from corral.control.schema import migrate
from corral.db import connect
from corral.errors import InvalidArgument, NotFound, Unavailable
from corral.log import get_logger

log = get_logger("corral.cluster")

Say = Callable[[str], None]


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _ray_env() -> dict[str, str]:
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}


def start_local_ray(count: int, port: int, say: Say) -> str:
    """`count` Ray nodes on this machine (a head and count-1 workers)."""
    address = f"127.0.0.1:{port}"
    common = ["--num-cpus=1", "--object-store-memory=80000000", "--disable-usage-stats"]
    say(f"starting a local Ray cluster of {count} nodes at {address}")
    subprocess.run(
        [_ray_bin(), "start", "--head", f"--port={port}", "--include-dashboard=false", *common],
        check=True, capture_output=True, env=_ray_env(),
    )  # fmt: skip
    for _ in range(count - 1):
        subprocess.run(
            [_ray_bin(), "start", f"--address={address}", *common],
            check=True, capture_output=True, env=_ray_env(),
        )  # fmt: skip
    return address


def stop_local_ray() -> None:
    subprocess.run([_ray_bin(), "stop", "--force"], capture_output=True, env=_ray_env())


def _ray_init(address: str) -> None:
    import ray

    ray.init(address=address, namespace=NAMESPACE, logging_level=logging.ERROR, log_to_driver=False)


def _ray_nodes(ray: Any) -> list[dict[str, Any]]:
    alive = [n for n in ray.nodes() if n["Alive"]]
    # The head first, then by id: stable for one Ray cluster.
    return sorted(
        alive, key=lambda n: ("node:__internal_head__" not in n["Resources"], n["NodeID"])
    )


async def up(
    directory: Path,
    *,
    local_nodes: int | None = None,
    ray_address: str | None = None,
    ray_port: int = 6390,
    state: str | None = None,
    pg_port: int = 5433,
    gateway_host: str = "127.0.0.1",
    gateway_port: int = 7070,
    node_port: int = 7100,
    node_timeout: float = 10.0,
    images: Path | None = None,
    timeout: float = 180.0,
    say: Say = print,
) -> dict[str, Any]:
    if local_nodes is not None and not 1 <= local_nodes <= 16:
        raise InvalidArgument("local_nodes", "must be between 1 and 16", local_nodes)
    if (local_nodes is None) == (ray_address is None):
        raise InvalidArgument(
            "local_nodes", "give exactly one of --local-nodes N and --ray-address", local_nodes
        )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "cluster.json"
    doc: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    doc.setdefault("node_key", "cn_" + secrets.token_urlsafe(24))
    if state is None:
        say("starting PostgreSQL (the state store)")
        state = await asyncio.to_thread(LocalPostgres(directory / "pg", pg_port).start)
        doc["local_pg"] = {"dir": str(directory / "pg"), "port": pg_port}
    doc["state"] = state
    if local_nodes is not None:
        ray_address = await asyncio.to_thread(start_local_ray, local_nodes, ray_port, say)
        doc["local_ray"] = True
    doc["ray_address"] = ray_address
    assert ray_address is not None
    gw = GatewaySpec(gateway_host, gateway_port, state, doc["node_key"], node_timeout)
    specs = await asyncio.to_thread(
        _deploy, ray_address, directory, state, doc["node_key"], local_nodes is not None,
        node_port, images, gw, say,
    )  # fmt: skip
    doc["gateway"] = f"http://{gateway_host}:{gateway_port}"
    doc["nodes"] = {s.node: s.url for s in specs}
    say(f"waiting for {len(specs)} node agents and the gateway")
    await _wait_ready(doc, timeout)
    if "api_key" not in doc:
        doc["api_key"] = await _default_key(state)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    os.chmod(path, 0o600)
    say(f"cluster up: gateway {doc['gateway']}, {len(specs)} nodes; keys in {path}")
    return doc


def _deploy(
    ray_address: str,
    directory: Path,
    state: str,
    node_key: str,
    local: bool,
    node_port: int,
    images: Path | None,
    gw: GatewaySpec,
    say: Say,
) -> list[NodeSpec]:
    """One pinned, detached, restartable node-agent actor per alive Ray
    node, and the gateway actor on the head. Existing actors are kept."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from corral.cluster.actors import GatewayActor, NodeAgentActor

    ray.init(
        address=ray_address, namespace=NAMESPACE, logging_level=logging.ERROR, log_to_driver=False
    )
    try:
        ray_nodes = _ray_nodes(ray)
        specs: list[NodeSpec] = []
        for i, rn in enumerate(ray_nodes):
            name = f"n{i}" if local else "n" + rn["NodeID"][:10]
            specs.append(
                NodeSpec(
                    node=name,
                    data_dir=str(directory / "nodes" / name),
                    host=rn["NodeManagerAddress"],
                    # One machine may hold several nodes: each its own port,
                    # address pool and DNS port.
                    port=node_port + i,
                    state=state,
                    node_key=node_key,
                    images=str(images) if images else None,
                    network_pool=f"10.{200 + i}.0.0/16",
                    dns_port=10053 + i,
                )
            )
            say(f"node agent {name} on Ray node {rn['NodeID'][:12]} at {specs[-1].url}")
            ray.remote(NodeAgentActor).options(
                name=f"corral-node-{name}",
                namespace=NAMESPACE,
                lifetime="detached",
                max_restarts=-1,
                num_cpus=0,
                get_if_exists=True,
                scheduling_strategy=NodeAffinitySchedulingStrategy(rn["NodeID"], soft=False),
            ).remote(asdict(specs[-1]))
        ray.remote(GatewayActor).options(
            name="corral-gateway",
            namespace=NAMESPACE,
            lifetime="detached",
            max_restarts=-1,
            num_cpus=0,
            get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray_nodes[0]["NodeID"], soft=False),
        ).remote(asdict(gw))
        return specs
    finally:
        ray.shutdown()


async def _wait_ready(doc: dict[str, Any], timeout: float) -> None:
    db = await connect(doc["state"])
    deadline = time.monotonic() + timeout
    try:
        await migrate(db)
        async with httpx.AsyncClient() as http:
            while True:
                rows = {n.name: n for n in await nodes.list_nodes(db)}
                waiting = [
                    name
                    for name in doc["nodes"]
                    if name not in rows or rows[name].state != nodes.ALIVE
                ]
                try:
                    ok = (await http.get(doc["gateway"] + "/healthz")).status_code == 200
                except httpx.TransportError:
                    ok = False
                if not waiting and ok:
                    return
                if time.monotonic() > deadline:
                    raise Unavailable(
                        f"cluster not ready after {timeout:g} s: nodes {waiting} not "
                        f"heartbeating, gateway {'up' if ok else 'down'} (Ray's logs: "
                        "/tmp/ray/session_latest/logs)"
                    )
                await asyncio.sleep(0.5)
    finally:
        await db.aclose()


async def _default_key(state: str) -> str:
    db = await connect(state)
    try:
        try:
            await quotas.get_project(db, "default")
        except NotFound:
            await quotas.create_project(db, "default")
        return await quotas.create_key(db, "default")
    finally:
        await db.aclose()


def load(directory: Path) -> dict[str, Any]:
    path = directory / "cluster.json"
    if not path.exists():
        raise NotFound(f"no cluster in {directory} ({path} is missing): run corral cluster up")
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


async def down(directory: Path, *, say: Say = print) -> None:
    doc = load(directory)
    await _close_all(doc, say)
    await asyncio.to_thread(_stop_actors, doc, say)
    if doc.get("local_ray"):
        await asyncio.to_thread(stop_local_ray)
        say("stopped the local Ray nodes")
    if doc.get("local_pg"):
        pg = LocalPostgres(Path(doc["local_pg"]["dir"]), doc["local_pg"]["port"])
        await asyncio.to_thread(pg.stop)
        say("stopped PostgreSQL")
    (directory / "cluster.json").unlink()


def _stop_actors(doc: dict[str, Any], say: Say) -> None:
    if doc.get("ray_address"):
        try:
            import ray

            _ray_init(doc["ray_address"])
            for name in [*(f"corral-node-{n}" for n in doc.get("nodes", {})), "corral-gateway"]:
                try:
                    actor = ray.get_actor(name, namespace=NAMESPACE)
                except ValueError:
                    continue
                try:
                    ray.get(actor.stop.remote(), timeout=120)
                except Exception as exc:
                    say(f"{name}: clean stop failed ({exc}); killing it")
                ray.kill(actor, no_restart=True)
                say(f"stopped {name}")
            ray.shutdown()
        except ConnectionError as exc:
            say(f"Ray is not reachable ({exc}); nothing to stop there")


async def _close_all(doc: dict[str, Any], say: Say) -> None:
    from corral.api.http import HttpService

    for name, url in doc.get("nodes", {}).items():
        client = HttpService(url, api_key=doc["node_key"], timeout=60)
        try:
            held = await client.list()
            await asyncio.gather(*(client.close(s.id) for s in held), return_exceptions=True)
            say(f"node {name}: closed {len(held)} sandboxes")
        except Unavailable:
            say(f"node {name}: unreachable, its sandboxes are left to its next start")
        finally:
            await client.aclose()


async def status(directory: Path) -> list[nodes.NodeRow]:
    doc = load(directory)
    db = await connect(doc["state"])
    try:
        return await nodes.list_nodes(db)
    finally:
        await db.aclose()
