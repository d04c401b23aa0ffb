"""Fresh kernel randomness for a sandbox's copies (a fork, a restore).

A copy holds its source's memory to the byte. Where the kernel is the
sandbox's own (a VM's guest), so is the CRNG state: the node sends each copy
64 fresh bytes, credited to its pool, and has its CRNG re-keyed
(corral-init's REQ_RESEED). Where the kernel is the host's (a container),
the host CRNG is re-keyed once for all of them (host/entropy.py says why
that matters at all). A reseed that fails is logged and counted but does
not fail the copy: the guest kernel also reseeds itself, within a minute.

A guest also wakes with the wall clock it was saved with (a resume hours
later, a template made yesterday): the node sets it (REQ_SETTIME) on every
guest it loads from a state. Its monotonic clocks carry on.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path

from corral import metrics
from corral.api.models import SandboxInfo
from corral.errors import CorralError
from corral.execd.client import ExecdClient
from corral.host import entropy
from corral.images.disks import is_disk
from corral.log import get_logger
from corral.node.lifecycle import control_path

log = get_logger("corral.node")


async def reseed_copies(run_dir: Path, copies: list[SandboxInfo]) -> None:
    if any(c.kind == "container" for c in copies):
        why = entropy.reseed()
        metrics.RESEEDS.labels("host", "failed" if why else "ok").inc()
        if why is not None:
            log.warning("sandbox.reseed_failed", kernel="host", reason=why)

    async def guest(info: SandboxInfo) -> None:
        client = ExecdClient(str(control_path(run_dir, info.id)))
        try:
            await client.reseed(secrets.token_bytes(64))
            await client.set_time(time.time_ns())
        except (CorralError, OSError) as exc:
            metrics.RESEEDS.labels("guest", "failed").inc()
            log.warning("sandbox.reseed_failed", sandbox=info.id, kernel="guest", reason=str(exc))
        else:
            metrics.RESEEDS.labels("guest", "ok").inc()

    # A user's own disk has no agent to take the seed: its OS reseeds
    # itself (or not), as on the machine it was installed on.
    guests = [c for c in copies if c.kind != "container" and not is_disk(c.image)]
    await asyncio.gather(*(guest(c) for c in guests))


async def set_guest_clock(run_dir: Path, sandbox_id: str) -> None:
    """The wall clock of a guest resumed from its saved state, set to now."""
    try:
        await ExecdClient(str(control_path(run_dir, sandbox_id))).set_time(time.time_ns())
    except (CorralError, OSError) as exc:
        log.warning("sandbox.clock_failed", sandbox=sandbox_id, reason=str(exc))
