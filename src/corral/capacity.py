"""What a node can still take: written by its admission, sent with every
heartbeat, read by placement and `corral cluster status`.

Typed here, once, so the three readers agree on names and units; on the
wire (the nodes table) it is the JSON of `to_wire()`, and `from_wire`
accepts a row written by an older node (missing fields take defaults).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class NodeCapacity:
    max_sandboxes: int = 0
    active: int = 0  # sandboxes in an active state (creating .. closing)
    held: int = 0  # of those, the ones a gateway made (labelled corral.project)
    memory_budget: int = 0  # bytes: host memory x memory_overcommit
    memory_promised: int = 0  # bytes promised to active sandboxes
    cpus: int = 1
    cpu_budget: float = 0.0  # cpus x cpu_overcommit (0: an older node, unknown)
    cpu_promised: float = 0.0
    # Why the host refuses creates now (memory_free, pressure), "" when it
    # does not: placement skips such a node until a heartbeat clears it.
    overloaded: str = ""
    kinds: tuple[str, ...] = ()
    vm_accel: str | None = None
    images: tuple[str, ...] = field(default=())
    # By content (images/store.py inventory): tag -> digest, and digest ->
    # (the layer it stacks on or "", bytes). Placement prefers the nodes
    # holding most of a sandbox's layers' bytes.
    tags: dict[str, str] = field(default_factory=dict)
    layers: dict[str, tuple[str, int]] = field(default_factory=dict)

    @property
    def free_slots(self) -> int:
        return self.max_sandboxes - self.active

    @property
    def free_memory(self) -> int:
        return self.memory_budget - self.memory_promised

    @property
    def free_cpu(self) -> float:
        return self.cpu_budget - self.cpu_promised if self.cpu_budget else float("inf")

    def to_wire(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["kinds"], doc["images"] = list(self.kinds), list(self.images)
        doc["layers"] = {d: [p, n] for d, (p, n) in self.layers.items()}
        return doc

    @classmethod
    def from_wire(cls, doc: dict[str, Any] | None) -> NodeCapacity:
        doc = doc or {}
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in doc.items() if k in known}
        for k in ("kinds", "images"):
            if k in kw:
                kw[k] = tuple(kw[k])
        if "layers" in kw:
            kw["layers"] = {str(d): (str(p), int(n)) for d, (p, n) in kw["layers"].items()}
        return cls(**kw)
