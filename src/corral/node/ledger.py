"""Releasing what sandboxes hold: one releaser per resource kind.

Every resource is a (kind, ref) row in the store, written before the
resource exists (node/store.py). The ledger knows, for each kind, the one
function that releases it: the node's own kinds (dir, subvolume, socket,
cgroup, net, idmap) and each runtime's (container, vm). Two runtimes may
name the same releaser (container and fncall share one OCI runtime), never
two different ones: a kind with two owners would be released twice or,
worse, by the wrong one. Every releaser is idempotent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from corral.log import get_logger
from corral.node.store import Store
from corral.runtimes.base import Releaser

log = get_logger("corral.node")


def combine(*tables: Mapping[str, Releaser]) -> dict[str, Releaser]:
    """One table from several; a kind claimed by two different releasers
    is refused (ValueError: a wiring bug)."""
    out: dict[str, Releaser] = {}
    for table in tables:
        for kind, releaser in table.items():
            if kind in out and out[kind] != releaser:
                raise ValueError(f"resource kind {kind!r} has two releasers")
            out[kind] = releaser
    return out


class Ledger:
    def __init__(self, store: Store, releasers: Mapping[str, Releaser]) -> None:
        self.store = store
        self.releasers = dict(releasers)

    @property
    def kinds(self) -> Iterable[str]:
        return self.releasers

    async def release(self, kind: str, ref: str) -> None:
        """Release one resource; idempotent (releasing a gone thing is fine)."""
        releaser = self.releasers.get(kind)
        if releaser is None:
            raise ValueError(f"unknown resource kind {kind!r}")
        await releaser(ref)

    async def release_all(self, sandbox_id: str) -> list[str]:
        """Release every resource of the sandbox, newest first, then drop
        the rows of those that went, in one transaction (one commit, not
        one per resource: a close's cost). A crash before it leaves rows of
        released resources; recovery releases them again, which is why
        every releaser is idempotent. Returns what failed (gc retries it)."""
        errors, gone = [], []
        for kind, ref in self.store.resources(sandbox_id):
            try:
                await self.release(kind, ref)
                gone.append((kind, ref))
            except Exception as exc:  # keep going: gc retries what is left
                errors.append(f"{kind} {ref}: {exc}")
                log.error(
                    "resource.release_failed",
                    sandbox=sandbox_id,
                    kind=kind,
                    ref=ref,
                    error=str(exc),
                )
        with self.store.transaction():
            for kind, ref in gone:
                self.store.drop_resource(sandbox_id, kind, ref)
        return errors
