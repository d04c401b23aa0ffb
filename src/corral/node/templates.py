"""Full VM desktops started from a saved drawn desktop instead of booted.

A full VM boots for seconds under TCG (its kernel, init, X, the session:
8.4 s for twm, ~58 s for XFCE) into a desktop that is the same for every
sandbox of the same spec. So the node keeps one per spec: the first
create of a spec boots as usual and, once its desktop is drawn and before
it is handed out, is saved (the guest paused ~0.2 s) as the spec's
template; a later create loads that state, as a fork's copy does, and
gets fresh kernel randomness and the time (node/reseed.py).

The key is everything the saved machine depends on: the layers by digest,
the guest artefacts' version, memory, CPUs, writable disk, screen size,
and the node's VM settings (pmem, page reporting, TCG cache). Only full
VMs of Corral's images without a network qualify (a network's address is
given to the guest at boot; a user's own disk has an overlay to carry).

Copies of a template share what was random in it when it was saved: its
address-space layout and the kernel's early random state (the CRNG is
re-keyed on load). That is no way into another sandbox, but it is why a
node that does not want it sets `vm_templates = 0`.

At most `keep` templates stay on disk (the least recently used go). A
create loads its own hard link to the file, so an eviction meanwhile
cannot pull the state from under a QEMU about to read it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import time
from pathlib import Path

from corral.api.models import CreateSandbox
from corral.images.disks import is_disk
from corral.log import get_logger
from corral.runtimes.base import Snapshottable

log = get_logger("corral.templates")

SUFFIX = ".state"


class Templates:
    def __init__(self, root: Path, keep: int, settings: dict[str, object]) -> None:
        self.root = root
        self.keep = keep
        self.settings = settings  # the node's VM settings, part of every key
        self._locks: dict[str, asyncio.Lock] = {}

    def applies(self, req: CreateSandbox, layers: list[str]) -> bool:
        """Whether a create may start from a template at all (checked
        before the runtime's state version, which costs a process)."""
        if self.keep <= 0 or req.kind != "fullvm" or req.network is not None:
            return False
        return not is_disk(req.image) and bool(layers)

    def key(self, req: CreateSandbox, layers: list[str], version: str) -> str | None:
        """The template a create may start from, or None if it may not."""
        if not self.applies(req, layers):
            return None
        doc = {
            "layers": layers,
            "version": version,
            "memory": req.memory,
            "cpu": req.cpu,
            "disk": req.disk,
            "display": list(req.display_size or ()),
            "node": self.settings,
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:32]

    def _path(self, key: str) -> Path:
        return self.root / f"{key}{SUFFIX}"

    def take(self, key: str, into: Path) -> Path | None:
        """A hard link to the template `key` at `into`, if there is one
        (and the template marked used)."""
        path = self._path(key)
        try:
            os.link(path, into)
        except FileNotFoundError:
            return None
        _used(path)
        return into

    async def make(self, runtime: Snapshottable, sandbox_id: str, key: str) -> None:
        """Save the running sandbox `sandbox_id` as the template `key`,
        unless another create already did. Never fails the create: a
        template is an optimisation."""
        lock = self._locks.setdefault(key, asyncio.Lock())
        if lock.locked():
            return  # another create of the spec is making it
        async with lock:
            final = self._path(key)
            if final.exists():
                return
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f".{key}.{secrets.token_hex(4)}.tmp"
            try:
                size = await runtime.snapshot(sandbox_id, tmp)
                os.replace(tmp, final)
                _used(final)
            except Exception as exc:  # the sandbox runs on either way
                log.warning("template.failed", sandbox=sandbox_id, key=key, error=str(exc))
                return
            finally:
                tmp.unlink(missing_ok=True)
            log.info("template.made", sandbox=sandbox_id, key=key, bytes=size)
            self._evict()

    def drop(self, key: str, why: str) -> None:
        """Forget a template whose state did not load (QEMU upgraded under
        it, a file damaged): the next create of its spec boots and saves
        a new one, instead of every create failing on it."""
        self._path(key).unlink(missing_ok=True)
        log.warning("template.dropped", key=key, why=why)

    def _evict(self) -> None:
        found = sorted(self.root.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for old in found[: max(0, len(found) - self.keep)]:
            old.unlink(missing_ok=True)
            log.info("template.dropped", key=old.stem)


def _used(path: Path) -> None:
    # The least recently used goes first. Set from the clock, not left to
    # the file system's (coarse: two uses within one tick would tie).
    now = time.time_ns()
    os.utime(path, ns=(now, now))
