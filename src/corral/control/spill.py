"""A create placed on a burst target (control/burst.py), for a view.

The row is reserved at home first, on the target, charged to the caller's
project; the cap is checked after (so concurrent creates and replicas
never exceed it together); then the target's gateway is asked under the
same idempotency key, so a retry finds the sandbox it made. Any failure
fails the row (releasing the charge) and the next target is tried; a
charge is therefore held once, by the one row, whatever the retries.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence

from corral import labels as platform_labels
from corral import metrics
from corral.api.models import CreateSandbox, SandboxInfo
from corral.control import sandboxes
from corral.control.burst import BurstRefused, home_id, remote_labels
from corral.control.core import GatewayCore
from corral.control.sandboxes import SandboxRow
from corral.errors import (
    Conflict,
    CorralError,
    NodeFull,
    ResourceExhausted,
    SandboxLost,
    Unauthenticated,
    Unavailable,
)
from corral.log import get_logger

log = get_logger("corral.gateway")
# A view's _reserve: rows for keys on a node, charged to its project.
Reserve = Callable[[Sequence[str], str, str, float, int], Awaitable[list[tuple[SandboxRow, bool]]]]


async def create(
    gw: GatewayCore,
    reserve: Reserve,
    get: Callable[[str], Awaitable[SandboxInfo]],
    req: CreateSandbox,
    key: str,
) -> SandboxInfo:
    """The sandbox on the first target that takes it; BurstRefused if none."""
    db = gw.db
    reasons: list[str] = []
    for target in gw.burst.by_name.values():
        [(row, new)] = await reserve([key], target.name, req.kind, req.cpu, req.memory)
        if not new:
            if row.state == "ready" and row.id is not None:
                return await get(row.id)  # a retry: made already
            raise Conflict(
                "another request is creating the sandbox for this idempotency key: "
                "retry with the same key to get it"
            )
        if await sandboxes.count_on_node(db, target.name) > target.cap:
            why = f"burst target {target.name} is at its cap of {target.cap} sandboxes"
            metrics.GATEWAY_BURST.labels(target.name, "cap").inc()
            await sandboxes.finish(db, key, "failed", why)
            reasons.append(why)
            continue
        to_remote = req.model_copy(
            update={
                "idempotency_key": key,
                "labels": remote_labels(req.labels, set(platform_labels.RESERVED)),
            }
        )
        try:
            info = await gw.burst.client(target.name).create(to_remote)
        except CorralError as exc:
            why = _why(target.name, exc)
            metrics.GATEWAY_BURST.labels(target.name, exc.code).inc()
            await sandboxes.finish(db, key, "failed", why)
            log.warning("burst.refused", target=target.name, reason=why)
            reasons.append(why)
            continue
        home = home_id(target.name, info.id)
        if await sandboxes.mark_ready(db, key, home, remote_id=info.id) is None:
            with contextlib.suppress(CorralError):
                await gw.burst.client(target.name).close(info.id)
            raise SandboxLost(f"sandbox {home} was written off while it was being created")
        metrics.GATEWAY_BURST.labels(target.name, "placed").inc()
        log.info("burst.placed", target=target.name, sandbox=home)
        return info.model_copy(update={"id": home})
    raise BurstRefused(reasons)


def _why(target: str, exc: CorralError) -> str:
    if isinstance(exc, Unauthenticated):
        return f"burst target {target} refused its API key ({exc.message})"
    if isinstance(exc, Unavailable):
        return f"burst target {target} is unreachable ({exc.message})"
    if isinstance(exc, NodeFull | ResourceExhausted):
        return f"burst target {target} is full ({exc.message})"
    return f"burst target {target} refused the create: {exc.code}: {exc.message}"
