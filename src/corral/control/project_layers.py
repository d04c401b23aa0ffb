"""A project's own layers, through a gateway: listed and deleted on every node.

A node's image store is shared by every project placed on it, so a gateway
never lists or deletes a node's layers as such. What it can give a project
is the layers that project committed: a node labels each commit made
through a gateway with the committing project (labels.PROJECT, which no
caller can set), and the label is part of the layer's digest, so a node's
answer to "the layers labelled P" is P's own and nothing else. The
operator's images are listed and deleted on the nodes (`corral image`).
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Iterable

from corral import labels as platform_labels
from corral.api.models import LayerInfo, SandboxInfo
from corral.control import nodes
from corral.control.core import GatewayCore
from corral.control.nodes import NodeRow
from corral.control.project_images import own
from corral.errors import Conflict, CorralError, ImageNotFound, InvalidArgument, Unavailable
from corral.log import get_logger

log = get_logger("corral.gateway")


async def listed(
    gw: GatewayCore, project: str, labels: dict[str, str] | None = None
) -> builtins.list[LayerInfo]:
    """`project`'s own layers (with `labels`) on every live node, once
    each: a layer on two nodes (a commit fetched by another) is one, in
    use where any node uses it."""
    want = {**(labels or {}), platform_labels.PROJECT: project}
    alive = [n for n in await gw.nodes() if n.state == nodes.ALIVE]
    answers = await asyncio.gather(
        *(gw.client(n).list_layers(want) for n in alive), return_exceptions=True
    )
    found: dict[str, LayerInfo] = {}
    failed = []
    for node, answer in zip(alive, answers, strict=True):
        if isinstance(answer, BaseException):
            if not isinstance(answer, CorralError):
                raise answer
            log.warning("layers.list_failed", node=node.name, error=str(answer))
            failed.append(node.name)
            continue
        for layer in answer:
            if layer.labels.get(platform_labels.PROJECT) != project:
                continue  # a node's filter, held to it
            seen = found.get(layer.digest)
            names = sorted({*(seen.names if seen else []), *layer.names})
            in_use = layer.in_use or (seen is not None and seen.in_use)
            found[layer.digest] = layer.model_copy(update={"names": names, "in_use": in_use})
    if failed and len(failed) == len(alive):
        raise Unavailable(f"no node answered for its layers: {', '.join(failed)}")
    return sorted(found.values(), key=lambda x: (x.created, x.digest))


async def delete(gw: GatewayCore, project: str, ref: str, running: Iterable[SandboxInfo]) -> None:
    """Delete `project`'s layer `ref` (its digest, or one of its own names)
    from every node that holds it. ImageNotFound where no node holds such a
    layer of the project's; Conflict, before anything is deleted, while one
    of `running` (the project's sandboxes: no other project's can run on
    its layers) runs on it or a node says a sandbox of its own (a warm
    pool's) is on it; InvalidArgument for a name that is not the
    project's. A sandbox started on it between the listing and a node's
    delete still makes that node refuse, after the nodes before it deleted
    their copies: the Conflict then says so."""
    if not ref.startswith(("sha256:", own(project))):
        raise InvalidArgument(
            "ref",
            f"must be a digest or one of your own images ({own(project)}...) through a "
            f"gateway; the operator's are deleted on the nodes",
            ref,
        )
    held: list[tuple[NodeRow, str]] = []
    silent: list[str] = []
    busy: list[str] = []
    for node in [n for n in await gw.nodes() if n.state == nodes.ALIVE]:
        try:
            found = await gw.client(node).list_layers({platform_labels.PROJECT: project})
        except CorralError as exc:  # the others are deleted from; the caller is told
            log.warning("layers.list_failed", node=node.name, error=str(exc))
            silent.append(node.name)
            continue
        for layer in found:
            mine = layer.labels.get(platform_labels.PROJECT) == project
            if mine and (ref == layer.digest or ref in layer.names):
                held.append((node, layer.digest))
                if layer.in_use:
                    busy.append(node.name)
    if not held:
        if silent:
            raise Unavailable(f"nodes {', '.join(silent)} did not answer: {ref!r} not deleted")
        raise ImageNotFound(f"no layer {ref!r} of project {project!r}", ref=ref)
    used = {digest for info in running for digest in info.layers}
    for _, digest in held:
        if digest in used:
            raise Conflict(f"layer {ref!r} is in use by a sandbox of project {project!r}", ref=ref)
    if busy:
        raise Conflict(
            f"layer {ref!r} is in use on nodes {', '.join(busy)} (a sandbox or a warm pool "
            "there is on it): nothing deleted", ref=ref,
        )  # fmt: skip
    deleted = 0
    for node, digest in held:
        try:
            await gw.client(node).delete_layer(digest)
            deleted += 1
        except ImageNotFound:
            continue  # gone meanwhile (nodes that share one store: the first took it)
        except Conflict as exc:  # a sandbox started on it since the listing
            if not deleted:
                raise
            raise Conflict(
                f"{ref!r} deleted from {deleted} node(s), then {node.name} refused: {exc.message}",
                ref=ref,
            ) from exc
    if not deleted:
        raise ImageNotFound(f"no layer {ref!r} of project {project!r}", ref=ref)
    if silent:  # a copy there would be listed again
        raise Unavailable(
            f"{ref!r} deleted from {deleted} node(s); nodes {', '.join(silent)} did not answer: "
            "delete it again once they do"
        )
