"""`corral cluster down`, and the failure path of `up`: stop what the
journal (cluster/journal.py) says was started, in the reverse order.

1. Close every sandbox through its node agent (the API: quotas, rows).
2. Stop the node-agent and gateway actors through Ray; an agent that stops
   cleanly leaves no mount, cgroup or process.
3. Stop the local Ray, and only it (cluster/localray.py); never a Ray
   that `up` did not start.
4. Clean each local node's data directory: a node agent killed with its
   Ray (or never reached) leaves sandboxes, mounts and cgroups; an agent
   started here on that directory recovers them (node/recovery.py), closes
   what it finds and stops, as after any crash.
5. Stop the local PostgreSQL.

Every step runs even if one before it failed; the journal is removed only
when every step succeeded, so a second `down` can finish the job.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral.cluster import journal, localray
from corral.cluster.actors import NAMESPACE
from corral.control.postgres import LocalPostgres
from corral.errors import CorralError, Unavailable
from corral.log import get_logger

log = get_logger("corral.cluster")
Say = Callable[[str], None]
ALL = frozenset({"local_pg", "local_ray", "actors"})


async def down(directory: Path, *, say: Say = print) -> None:
    doc = journal.load(directory)
    if await teardown(directory, doc, parts=set(ALL), say=say):
        journal.remove(directory)
    else:
        raise Unavailable(
            f"cluster down left parts running (above); {journal.path_of(directory)} is kept: "
            "run `corral cluster down` again"
        )


async def teardown(directory: Path, doc: dict[str, Any], *, parts: set[str], say: Say) -> bool:
    """Stop the `parts` the journal records; True if all of it stopped."""
    ok = True
    if "actors" in parts and doc.get("nodes"):
        await _close_all(doc, say)
        if doc.get("ray_address") and _reachable(doc["ray_address"]):
            ok &= await asyncio.to_thread(_stop_actors, doc, say)
        elif doc.get("ray_address"):
            say(f"Ray at {doc['ray_address']} does not answer: no actor to stop there")
    if "local_ray" in parts and "local_ray" in doc:
        try:
            n = await asyncio.to_thread(localray.stop, directory)
            say(f"stopped the local Ray ({n} processes)")
        except CorralError as exc:
            say(f"the local Ray: {exc.message}")
            ok = False
    if "actors" in parts:
        for spec in doc.get("node_specs", []):
            if "local_ray" in doc:  # its data dir is on this machine
                ok &= await _clean_node(spec, say)
    if "local_pg" in parts and "local_pg" in doc:
        pg = LocalPostgres(Path(doc["local_pg"]["dir"]), doc["local_pg"]["port"])
        try:
            await asyncio.to_thread(pg.stop)
            say("stopped PostgreSQL")
        except Exception as exc:  # pg_ctl's own failure, as text
            say(f"PostgreSQL did not stop: {exc}")
            ok = False
    return ok


def _reachable(address: str) -> bool:
    """Whether Ray's GCS accepts connections: ray.init on a dead address
    retries for a minute."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=2):
            return True
    except (OSError, ValueError):
        return False


async def _close_all(doc: dict[str, Any], say: Say) -> None:
    from corral.api.http import HttpService

    for name, url in doc.get("nodes", {}).items():
        client = HttpService(url, api_key=doc["node_key"], timeout=60)
        try:
            held = await client.list()
            await asyncio.gather(*(client.close(s.id) for s in held), return_exceptions=True)
            say(f"node {name}: closed {len(held)} sandboxes")
        except CorralError as exc:
            # Not answering, or something else on its port (a CI run met
            # another process's HTTP server there): the teardown goes on,
            # the node's data dir is cleaned below.
            say(f"node {name}: {exc.message} (its data dir is cleaned below)")
        finally:
            await client.aclose()


def _stop_actors(doc: dict[str, Any], say: Say) -> bool:
    import ray

    ok = True
    try:
        localray.init(doc["ray_address"])
    except ConnectionError as exc:
        say(f"Ray is not reachable ({exc}); no actor to stop there")
        return "local_ray" in doc  # its processes are stopped next
    try:
        for name in [*(f"corral-node-{n}" for n in doc.get("nodes", {})), "corral-gateway"]:
            try:
                actor = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                continue
            try:
                ray.get(actor.stop.remote(), timeout=120)
            except Exception as exc:
                say(f"{name}: clean stop failed ({exc}); killing it")
                ok = "local_ray" in doc  # then its data dir is cleaned below
            ray.kill(actor, no_restart=True)
            say(f"stopped {name}")
    finally:
        ray.shutdown()
    return ok


async def _clean_node(spec: dict[str, Any], say: Say) -> bool:
    """Recover a node's data dir and leave it holding nothing."""
    from corral.cluster.actors import NodeSpec
    from corral.node.agent import NodeAgent

    s = NodeSpec(**spec)
    if not Path(s.data_dir).exists():
        return True
    try:
        agent = NodeAgent(s.config())
        await agent.start()
        try:
            left = await agent.list()
            for sbx in left:
                with contextlib.suppress(CorralError):
                    await agent.close(sbx.id)
        finally:
            await agent.aclose()
    except CorralError as exc:
        say(f"node {s.node}: cleaning {s.data_dir} failed: {exc.message}")
        return False
    if left:
        say(f"node {s.node}: cleaned {s.data_dir} ({len(left)} sandboxes closed)")
    return True
