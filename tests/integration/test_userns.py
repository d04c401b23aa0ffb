"""Sandbox root is not host root: each sandbox runs in a user namespace
mapped onto its own block of host ids, freed when it closes."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import corral
from corral.node.admission import ID_BASE
from corral.runtimes.container.bundle import IDS

from ..framework import IMAGE, Node


def _uid_map(text: str) -> tuple[int, int, int]:
    inside, outside, size = (int(x) for x in text.split())
    return inside, outside, size


def _host_uids_of(marker: str) -> list[int]:
    """Real uids, as the host sees them, of processes whose command line
    holds `marker`."""
    uids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if marker.encode() not in cmdline:
                continue
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
        uids.append(int(uid_line.split()[1]))
    return uids


async def test_each_sandbox_gets_its_own_block_of_host_ids(
    embedded: corral.AsyncClient,
) -> None:
    a, b = await asyncio.gather(
        embedded.sandboxes.create(image=IMAGE), embedded.sandboxes.create(image=IMAGE)
    )
    maps = []
    for sbx in (a, b):
        r = await sbx.commands.run("cat /proc/self/uid_map /proc/self/gid_map; id -u")
        lines = r.stdout.splitlines()
        uid_map, gid_map = _uid_map(lines[0]), _uid_map(lines[1])
        assert uid_map == gid_map and lines[2] == "0"
        inside, outside, size = uid_map
        assert inside == 0 and size == IDS and outside >= ID_BASE
        assert (outside - ID_BASE) % IDS == 0
        maps.append(outside)
    assert maps[0] != maps[1]

    # The image's files are root's inside; the sandbox's root owns its root.
    r = await a.commands.run("stat -c '%u %g' /usr/bin/python3 / /etc/passwd")
    assert r.stdout.split() == ["0", "0"] * 3

    # Seen from the host, the sandbox's root is an unprivileged id.
    marker = "7391.25"
    h = await a.commands.start(f"sleep {marker}")
    try:
        for _ in range(50):
            if uids := _host_uids_of(f"sleep\0{marker}"):
                break
            await asyncio.sleep(0.05)
        assert uids == [maps[0]]
    finally:
        await h.kill()
    await asyncio.gather(a.close(), b.close())


async def test_root_inside_cannot_act_as_host_root(embedded: corral.AsyncClient) -> None:
    sbx = await embedded.sandboxes.create(image=IMAGE)
    # A new user namespace inside buys nothing: ids outside the block are
    # unmapped, and the host's files under /proc/1/root are out of reach.
    r = await sbx.commands.run(
        "cat /proc/self/setgroups; "
        "python3 -c 'import os; os.setuid(70000)' 2>&1 | tail -1; "
        "chown 70000 /tmp 2>&1 | tail -1"
    )
    lines = r.stdout.splitlines()
    assert "Invalid argument" in lines[1], r.stdout
    assert "Invalid argument" in lines[2], r.stdout
    await sbx.close()


async def test_host_id_block_is_freed_on_close(embedded: corral.AsyncClient, node: Node) -> None:
    sbx = await embedded.sandboxes.create(image=IMAGE)
    slot = node.idmap_slot(sbx.id)
    assert slot is not None
    r = await sbx.commands.run("cat /proc/self/uid_map")
    assert int(r.stdout.split()[1]) == ID_BASE + slot * IDS  # the block the record names
    await sbx.close()
    assert node.idmap_slot(sbx.id) is None
