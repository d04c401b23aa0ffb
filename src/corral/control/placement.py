"""Where a new sandbox goes: filter, then the better of k random choices.

Filter: the node is alive, runs the sandbox's kind, and (by its last
heartbeat, less what this gateway has in flight to it) has a free slot and
the memory and CPUs to promise, and its host did not say it is overloaded
(free memory under its reserve, or a pressure stall at its limit). Among
the survivors, nodes that already hold the most bytes of the sandbox's
layers are preferred: layers are known by digest (each node reports its
tags and its layers), so a node that holds an image under another tag, or
the base layers of a new version, counts.
Then k of them are drawn at random and the one with the most free slots
wins. Capacity comes from heartbeats, so it is
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


class Inventory:
    """Every layer the nodes report, by digest, and every tag: the union
    over one membership snapshot (built once per snapshot, not per create)."""

    def __init__(self, nodes: Sequence[NodeRow]) -> None:
        self.tags: dict[str, str] = {}
        self.layers: dict[str, tuple[str, int]] = {}
        for n in nodes:
            self.tags.update(n.capacity.tags)
            self.layers.update(n.capacity.layers)

    def wanted(self, refs: Sequence[str]) -> dict[str, int]:
        """The layers (digest -> bytes) the references name: a tag through
        any node's tags, then each layer's stack down to its base. A
        reference no node knows adds nothing."""
        out: dict[str, int] = {}
        for ref in refs:
            digest: str | None = ref if ref.startswith("sha256:") else self.tags.get(ref)
            if digest is None and ":" not in ref.rsplit("/", 1)[-1]:
                digest = self.tags.get(ref + ":latest")
            while digest and digest in self.layers and digest not in out:
                parent, size = self.layers[digest]
                out[digest] = max(size, 1)
                digest = parent
        return out


def held(node: NodeRow, want: Mapping[str, int]) -> int:
    """Bytes of `want` that `node` holds."""
    return sum(size for digest, size in want.items() if digest in node.capacity.layers)


def choose(
    nodes: Sequence[NodeRow],
    *,
    kind: str,
    memory: int,
    cpu: float = 0.0,
    want: Mapping[str, int] | None = None,
    in_flight: Mapping[str, int] | None = None,
    exclude: Collection[str] = (),
    k: int = K,
    rng: random.Random | None = None,
) -> NodeRow:
    """`want`: the sandbox's layers (Inventory.wanted)."""
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
        if n.capacity.free_cpu < cpu:
            return why("not enough CPU to promise")
        if n.capacity.overloaded:
            return why("overloaded")
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
    if want:
        best = max(held(n, want) for n in candidates)
        if best > 0:
            candidates = [n for n in candidates if held(n, want) == best]
    drawn = rng.sample(candidates, min(k, len(candidates)))
    return max(
        drawn,
        key=lambda n: (n.capacity.free_slots - in_flight.get(n.name, 0), n.capacity.free_memory),
    )
