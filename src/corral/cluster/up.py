"""`corral cluster up / status`: Corral on a Ray cluster (down: cluster/down.py).

up: check every port and directory first (cluster/preflight.py: a failed
check starts nothing), then start the state store (a local PostgreSQL
unless --state names one), Ray (only with --local-nodes: N Ray nodes on
this machine, cluster/localray.py), one detached node-agent actor per alive
Ray node, pinned to it, and a gateway actor on the head node. Each part is
written to <dir>/cluster.json before it is started (cluster/journal.py), so
`down` finds it whatever happens to `up`. It returns once every node
heartbeats and the gateway answers. On any failure, or Ctrl-C, it stops what
it started and says what failed. Running it again starts only what is
missing.

The nodes share a blob store (--blobs: a directory, `corral blobd`'s URL,
or s3://; with --local-nodes, the machine's own image store by default)
and fetch the images they lack from it on first use (node/imagefetch.py).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from corral.addresses import host_name, host_networks
from corral.cluster import journal, localray, preflight
from corral.cluster.actors import NAMESPACE, GatewaySpec, NodeSpec
from corral.config import NodeConfig
from corral.control import keys, nodes, quotas
from corral.control.postgres import LocalPostgres
from corral.control.schema import migrate
from corral.db import connect
from corral.errors import CorralError, InvalidArgument, NotFound, Unavailable
from corral.log import get_logger

log = get_logger("corral.cluster")

Say = Callable[[str], None]
load = journal.load
MAX_LOCAL_NODES = 16


def default_blobs() -> str | None:
    """The machine's own image store (what `corral image build` fills), if
    it has one: local nodes fetch from it what they lack."""
    store = NodeConfig.from_env().images_dir
    return str(store) if (store / "layers").is_dir() else None


def _preflight(
    directory: Path, doc: dict[str, Any], *, local_nodes: int | None, state: str | None,
    pg_port: int, ray_port: int, gateway_host: str, gateway_port: int, node_port: int,
    dns_port: int,
) -> None:  # fmt: skip
    """Ports and directories, before anything starts. Parts the journal
    already has (a second `up`) hold their ports: those are not checked."""
    preflight.check_dir(directory, for_postgres=state is None and "local_pg" not in doc)
    ports: dict[str, tuple[str, int, bool]] = {}
    if state is None and "local_pg" not in doc:
        ports["pg_port"] = ("127.0.0.1", pg_port, False)
    if local_nodes is not None and "local_ray" not in doc:
        ports["ray_port"] = ("0.0.0.0", ray_port, False)
    if "gateway" not in doc:
        ports["gateway_port"] = (gateway_host, gateway_port, False)
    if local_nodes is not None and "nodes" not in doc:
        for i in range(local_nodes):
            ports[f"node_port + {i} (node n{i})" if i else "node_port"] = (
                "0.0.0.0", node_port + i, False,
            )  # fmt: skip
            ports[f"dns_port + {i} (node n{i}'s DNS)" if i else "dns_port"] = (
                "0.0.0.0", dns_port + i, True,
            )  # fmt: skip
    preflight.check_ports(ports)


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
    dns_port: int = 10053,
    node_timeout: float = 10.0,
    images: Path | None = None,
    blobs: str | None = None,
    burst: list[dict[str, Any]] | None = None,
    burst_threshold: float = 0.8,
    timeout: float = 180.0,
    say: Say = print,
) -> dict[str, Any]:
    if local_nodes is not None and not 1 <= local_nodes <= MAX_LOCAL_NODES:
        raise InvalidArgument(
            "local_nodes", f"must be between 1 and {MAX_LOCAL_NODES}", local_nodes
        )
    if (local_nodes is None) == (ray_address is None):
        raise InvalidArgument(
            "local_nodes", "give exactly one of --local-nodes N and --ray-address", local_nodes
        )
    directory = Path(os.path.abspath(directory))
    if blobs is not None:
        NodeConfig(image_sources=[blobs])  # the node's own check, before anything starts
    elif local_nodes is not None and images is None:
        blobs = default_blobs()
    doc = journal.load_or_new(directory)
    if doc and doc.get("phase") != journal.UP:
        # An `up` that failed or was killed: what it left is stopped first,
        # and this one starts from nothing.
        from corral.cluster.down import ALL, teardown

        say("a previous `cluster up` here did not finish: stopping what it started")
        if not await teardown(directory, doc, parts=set(ALL), say=say):
            raise Unavailable(
                f"parts of the unfinished cluster in {directory} did not stop (above): "
                "run `corral cluster down` and try again"
            )
        journal.remove(directory)
        doc = {}
    fresh = not doc
    _preflight(
        directory, doc, local_nodes=local_nodes, state=state, pg_port=pg_port,
        ray_port=ray_port, gateway_host=gateway_host, gateway_port=gateway_port,
        node_port=node_port, dns_port=dns_port,
    )  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    doc.setdefault("node_key", "cn_" + secrets.token_urlsafe(24))
    doc["phase"] = journal.STARTING
    journal.save(directory, doc)
    started: list[str] = []
    step = "checking"
    try:
        if state is None:
            step = "starting PostgreSQL"
            say("starting PostgreSQL (the state store)")
            if "local_pg" not in doc:
                doc["local_pg"] = {"dir": str(directory / "pg"), "port": pg_port}
                journal.save(directory, doc)
                started.append("local_pg")
            pg = LocalPostgres(Path(doc["local_pg"]["dir"]), doc["local_pg"]["port"])
            state = await asyncio.to_thread(pg.start)
        doc["state"] = state
        if local_nodes is not None:
            step = "starting Ray"
            if "local_ray" not in doc:
                doc["local_ray"] = {"port": ray_port, "nodes": local_nodes}
                journal.save(directory, doc)
                started.append("local_ray")
                ray_address = await asyncio.to_thread(
                    localray.start, local_nodes, ray_port, directory, say
                )
            else:
                ray_address = f"127.0.0.1:{doc['local_ray']['port']}"
        doc["ray_address"] = ray_address
        assert ray_address is not None
        step = "deploying the node agents and the gateway"
        gw = GatewaySpec(
            gateway_host, gateway_port, state, doc["node_key"], node_timeout,
            burst=list(burst or []), burst_threshold=burst_threshold,
        )  # fmt: skip

        def record(specs: list[NodeSpec]) -> None:
            """Before any actor is made: `down` then finds them all."""
            doc["nodes"] = {s.node: s.url for s in specs}
            doc["node_specs"] = [asdict(s) for s in specs]
            doc["gateway"] = f"http://{gateway_host}:{gateway_port}"
            journal.save(directory, doc)
            started.append("actors")

        specs = await asyncio.to_thread(
            _deploy, ray_address, directory, state, doc["node_key"], local_nodes is not None,
            node_port, dns_port, images, blobs, gw, record, say,
        )  # fmt: skip
        step = "waiting for the node agents and the gateway"
        say(f"waiting for {len(specs)} node agents and the gateway")
        logs = localray.temp_dir(directory) if "local_ray" in doc else Path("/tmp/ray")
        await _wait_ready(doc, timeout, logs)
        if "api_key" not in doc:
            doc["api_key"] = await _default_key(state)
        doc["phase"] = journal.UP
        journal.save(directory, doc)
    except BaseException as exc:
        # Stop what this `up` started (a second `up` leaves the parts the
        # first one made); say what failed, in one line, not a traceback.
        from corral.cluster.down import teardown

        what = exc.message if isinstance(exc, CorralError) else f"{type(exc).__name__}: {exc}"
        say(f"cluster up failed while {step}: {what}")
        say("stopping what it started: " + (", ".join(started) or "nothing"))
        await asyncio.shield(teardown(directory, doc, parts=set(started), say=say))
        if fresh:
            journal.remove(directory)
        if isinstance(exc, CorralError) or not isinstance(exc, Exception):
            raise
        raise Unavailable(f"cluster up failed while {step}: {what}") from exc
    say(
        f"cluster up: gateway {doc['gateway']}, {len(specs)} nodes; keys in "
        f"{journal.path_of(directory)}"
    )
    return doc


def _deploy(
    ray_address: str,
    directory: Path,
    state: str,
    node_key: str,
    local: bool,
    node_port: int,
    dns_port: int,
    images: Path | None,
    blobs: str | None,
    gw: GatewaySpec,
    record: Callable[[list[NodeSpec]], None],
    say: Say,
) -> list[NodeSpec]:
    """One pinned, detached, restartable node-agent actor per alive Ray
    node, and the gateway actor on the head. Existing actors are kept.
    `record` is given every spec before the first actor is made."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from corral.cluster.actors import GatewayActor, NodeAgentActor

    localray.init(ray_address)
    try:
        ray_nodes = localray.nodes(ray)
        key = os.environ.get("CORRAL_BLOB_KEY")
        deny = control_plane(
            [rn["NodeManagerAddress"] for rn in ray_nodes], ray_address, state, gw.host
        )
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
                    dns_port=dns_port + i,
                    image_sources=[blobs] if blobs else [],
                    env=node_env(key if blobs else None),
                    deny=deny,
                )
            )
        record(specs)
        for rn, spec in zip(ray_nodes, specs, strict=True):
            say(f"node agent {spec.node} on Ray node {rn['NodeID'][:12]} at {spec.url}")
            ray.remote(NodeAgentActor).options(
                name=f"corral-node-{spec.node}",
                namespace=NAMESPACE,
                lifetime="detached",
                max_restarts=-1,
                num_cpus=0,
                get_if_exists=True,
                scheduling_strategy=NodeAffinitySchedulingStrategy(rn["NodeID"], soft=False),
            ).remote(asdict(spec))
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


def node_env(blob_key: str | None) -> dict[str, str]:
    """What each node's actor gets of this environment: the blob store's
    key, and the registries the cluster pulls from (which the nodes' pull
    guard lets through wherever they resolve: images/egress.py)."""
    env = {"CORRAL_BLOB_KEY": blob_key} if blob_key else {}
    if os.environ.get("CORRAL_REGISTRIES"):
        env["CORRAL_REGISTRIES"] = os.environ["CORRAL_REGISTRIES"]
    return env


def control_plane(hosts: list[str], ray_address: str, state: str, gateway: str) -> list[str]:
    """The cluster's own hosts, every address each resolves to here (a /32
    or a /128), for every node's network_deny: the Ray nodes (each runs a
    raylet, a node agent, maybe the gateway), Ray's head, the state store
    and the gateway. A sandbox's policy may name a private range (an
    internal mirror); it never reaches these through it (Ray's ports take
    no key), and a tenant's registry pull never connects to them. Loopback
    is always denied; a name that does not resolve here is left out (the
    operator adds it: network_deny)."""
    names = {*hosts, host_name(ray_address), gateway, urlsplit(state).hostname or ""}
    out = set()
    for name in names - {"", "0.0.0.0", "::"}:
        out.update(host_networks(name))
    return sorted(out)


async def _wait_ready(doc: dict[str, Any], timeout: float, logs: Path) -> None:
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
                        f"{logs}/session_latest/logs)"
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
            await quotas.create_project(db, "default", operator=True)
        key, _ = await keys.create_key(db, "default", note="cluster up")
        return key
    finally:
        await db.aclose()


async def status(directory: Path) -> list[nodes.NodeRow]:
    doc = load(directory)
    db = await connect(doc["state"])
    try:
        return await nodes.list_nodes(db)
    finally:
        await db.aclose()
