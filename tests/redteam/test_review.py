"""The outside review's classes (issue 14, docs/guard.md): one test per
class, each with several variants, next to a neighbour that must not
notice, and each refusal counted in the audit by class."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import corral
from corral.config import NodeConfig

from . import review_attacks as r
from .attacks import IMAGE, Neighbour, during
from .test_attacks import check


async def test_32_bit_entry_is_refused_and_audited_as_its_64_bit_twin(
    attacker: corral.AsyncSandbox, neighbour: Neighbour
) -> None:
    before = await attacker.audit()
    outcome, ratio = await during(neighbour, r.int80_syscalls(attacker))
    await check(neighbour, outcome, ratio)
    audit = await attacker.audit()
    for name in r.PRIVILEGED_32:
        assert audit.syscalls.get(name, 0) >= 1, (name, audit.syscalls)
    assert audit.syscalls_denied.get("privileged", 0) >= len(r.PRIVILEGED_32)
    assert audit.syscalls_denied.get("socket-family", 0) >= 1
    # Nothing of it was filed under "other".
    assert audit.syscalls_denied.get("other", 0) == before.syscalls_denied.get("other", 0)


async def test_only_the_socket_families_a_sandbox_needs_are_allowed(
    attacker: corral.AsyncSandbox, neighbour: Neighbour
) -> None:
    outcome, ratio = await during(neighbour, r.socket_families(attacker))
    await check(neighbour, outcome, ratio)
    audit = await attacker.audit()
    assert audit.syscalls_denied.get("socket-family", 0) >= len(r.REFUSED_FAMILIES), audit


async def test_disk_beyond_the_pool_is_refused_by_admission(
    rt_client: corral.AsyncClient, rt_config: NodeConfig
) -> None:
    pool = rt_config.scratch_size
    for disk in ("4TiB", pool + 1, 64 * pool):
        with pytest.raises(corral.NodeFull) as exc:
            await rt_client.sandboxes.create(image=IMAGE, disk=disk)
        assert exc.value.details["reason"] == "disk" and "scratch pool" in exc.value.message
    # Nothing was made, and the pool still admits a sandbox of a fair size.
    assert not [s for s in await rt_client.sandboxes.list() if s.info.disk >= pool]
    ok = await rt_client.sandboxes.create(image=IMAGE, disk="64MiB")
    await ok.close()


async def test_disk_promised_is_bounded_by_pool_times_overcommit(
    rt_config: NodeConfig, data_root: Path
) -> None:
    small = replace(
        rt_config, data_dir=data_root / "disk", node="disk", scratch_size=1 << 30, disk_overcommit=2
    )
    async with corral.AsyncClient(config=small) as c:
        made = [await c.sandboxes.create(image=IMAGE, disk="768MiB") for _ in range(2)]
        with pytest.raises(corral.NodeFull, match="disk_overcommit 2"):
            await c.sandboxes.create(image=IMAGE, disk="768MiB")
        await made[0].close()  # released promises are admitted again
        made[0] = await c.sandboxes.create(image=IMAGE, disk="768MiB")
        for s in made:
            await s.close()


async def test_direct_io_is_throttled_per_sandbox(
    rt_client: corral.AsyncClient, neighbour: Neighbour, rt_config: NodeConfig
) -> None:
    streamer = await rt_client.sandboxes.create(image=IMAGE, disk="1GiB", labels={"role": "io"})
    outcome, ratio = await during(neighbour, r.direct_io_stream(streamer, mib=512))
    await check(neighbour, outcome, ratio)
    write, read = outcome.extra["rates"]
    # Long enough that the throttle's first slice of burst does not count.
    assert write <= rt_config.disk_write_bps * 1.1, outcome.detail
    assert read <= rt_config.disk_read_bps * 1.1, outcome.detail
    await streamer.close()
