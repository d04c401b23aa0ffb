"""Where a new sandbox goes: filter, then the better of k random choices.

Filter: the node is alive, runs the sandbox's kind, and (by its last
heartbeat, less what this gateway has in flight to it) has a free slot and
the memory to promise. Among the survivors, nodes that already hold the
image's layers are preferred. Then k of them are drawn at random and the
one with the most free slots wins. Capacity comes from heartbeats, so it is
stale by up to an interval; drawing k instead of taking the global best
keeps many gateways from piling onto one node with that same stale view.
The node agent still has the final say: it answers "full" and the gateway
asks another.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence

from corral.control.nodes import ALIVE, NodeRow
from corral.errors import ResourceExhausted

K = 2


def choose(
    nodes: Sequence[NodeRow],
    *,
    kind: str,
    image: str | None,
    memory: int,
    in_flight: Mapping[str, int] | None = None,
    exclude: Collection[str] = (),
    k: int = K,
    rng: random.Random | None = None,
) -> NodeRow:
    in_flight = in_flight or {}
    rng = rng or random.Random()
    reasons: dict[str, int] = {}

    def why(reason: str) -> bool:
        reasons[reason] = reasons.get(reason, 0) + 1
        return False

    def fits(n: NodeRow) -> bool:
        if n.state != ALIVE:
            return why(n.state)
        if n.name in exclude:
            return why("already refused this create")
        if kind not in n.capacity.kinds:
            return why(f"no {kind} backend")
        if n.capacity.free_slots - in_flight.get(n.name, 0) < 1:
            return why("full")
        if n.capacity.free_memory < memory:
            return why("not enough memory to promise")
        return True

    candidates = [n for n in nodes if fits(n)]
    if not candidates:
        detail = ", ".join(f"{count} {reason}" for reason, count in sorted(reasons.items()))
        raise ResourceExhausted(
            f"no node can take this {kind} sandbox: {len(nodes)} nodes known"
            + (f" ({detail})" if detail else ""),
            nodes=len(nodes),
            kind=kind,
        )
    if image is not None:
        cached = [n for n in candidates if image in n.capacity.images]
        candidates = cached or candidates
    drawn = rng.sample(candidates, min(k, len(candidates)))
    return max(
        drawn,
        key=lambda n: (n.capacity.free_slots - in_flight.get(n.name, 0), n.capacity.free_memory),
    )
