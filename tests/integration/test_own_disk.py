"""A user's own disk on a full VM: booted by its firmware (BIOS or UEFI),
with no Corral agent inside, driven through the screen alone; its writes
land in the sandbox's qcow2 overlay and never in the disk; suspend,
resume and fork carry the overlay with the memory.

The disk (tests/framework/bootdisk.py) is GRUB showing a menu: a key
moves its highlight, and its second entry writes to a FAT partition on
the disk (GRUB's save_env), which a later boot of the same disk shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import json
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import corral

from ..framework import IMAGE, Node, bootdisk, png_pixels

pytestmark = pytest.mark.requires_qemu


@pytest.fixture(scope="module")
def disks(node: Node, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """The test disk added to the node through the CLI, raw and qcow2."""
    why = bootdisk.missing_tools()
    if why:
        pytest.skip(why)
    raw, qcow2 = bootdisk.build(tmp_path_factory.mktemp("bootdisk"))
    added = {"grub-raw": raw, "grub-qcow2": qcow2}
    for name, path in added.items():
        node.cli("disk", "rm", name, check=False)
        node.cli("disk", "add", str(path), "--name", name)
    yield {name: node.config.disks_dir / name for name in added}
    for name in added:
        node.cli("disk", "rm", name, check=False)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _overlay(node: Node, sandbox_id: str) -> Path:
    doc = json.loads((node.config.sandboxes_dir / sandbox_id / "own-disk.json").read_text())
    return Path(doc["overlay"])


def _same_content(a: Path, b: Path) -> bool:
    """Whether two images show the guest the same bytes (qemu-img compare)."""
    proc = subprocess.run(["qemu-img", "compare", "-U", str(a), str(b)], capture_output=True)
    assert proc.returncode in (0, 1), proc.stderr
    return proc.returncode == 0


async def _shot(sbx: corral.AsyncSandbox) -> tuple[int, int, list[bytes]]:
    return png_pixels(await sbx.display.screenshot())


def _differ(a: list[bytes], b: list[bytes]) -> bool:
    """More than a blinking text cursor (one 16-row cell) apart."""
    return len(a) != len(b) or sum(x != y for x, y in zip(a, b, strict=True)) > 16


async def _changes(sbx: corral.AsyncSandbox, before: list[bytes], what: str) -> list[bytes]:
    """The screen once it differs from `before` and holds still."""
    deadline = time.monotonic() + 60
    while True:
        _, _, rows = await _shot(sbx)
        if _differ(rows, before):
            await asyncio.sleep(1)
            _, _, again = await _shot(sbx)
            if not _differ(again, rows):
                return again
        assert time.monotonic() < deadline, f"the screen never changed: {what}"
        await asyncio.sleep(0.3)


def _lit(rows: list[bytes]) -> int:
    """Pixels that are not black (GRUB's text and highlight)."""
    return sum(1 for row in rows for i in range(0, len(row), 3) if row[i : i + 3] != b"\0\0\0")


async def _write_entry(sbx: corral.AsyncSandbox, menu: list[bytes]) -> list[bytes]:
    """Pick the menu's second entry (it writes to the disk); the screen then."""
    await sbx.display.key("Down")
    moved = await _changes(sbx, menu, "the highlight never moved on Down")
    await sbx.display.key("Return")
    wrote = await _changes(sbx, moved, "the write entry never ran")
    assert _lit(wrote) < _lit(menu) // 4, "the menu should give way to one line (WROTE)"
    return wrote


async def test_a_raw_disk_boots_with_bios_takes_keys_writes_its_overlay_and_resumes(
    embedded: corral.AsyncClient, node: Node, disks: dict[str, Path]
) -> None:
    base = disks["grub-raw"]
    before = _sha(base)
    sbx = await embedded.sandboxes.create(kind="fullvm", image="disk:grub-raw", memory="512MiB")
    try:
        # Ready means drawn: the first screenshot is the menu, not a black screen.
        w, h, menu = await _shot(sbx)
        assert (w, h) == (720, 400), "GRUB under BIOS draws in VGA text mode"
        assert _lit(menu) > 2000, "the first screenshot should show GRUB's menu"
        wrote = await _write_entry(sbx, menu)
        # No agent: commands and files refuse, naming why.
        with pytest.raises(corral.InvalidArgument) as exc:
            await sbx.commands.run("true")
        assert exc.value.field == "image" and "no Corral agent" in str(exc.value)
        with pytest.raises(corral.InvalidArgument):
            await sbx.files.read("/etc/hostname")
        # Suspend to disk ends QEMU (the overlay flushed); resume loads the
        # same machine: the same screen, the write in the overlay only.
        await sbx.suspend("disk")
        assert node.qemu_processes(sbx.id) == []
        assert not _same_content(_overlay(node, sbx.id), base), "the guest's write is missing"
        await sbx.resume()
        _, _, after = await _shot(sbx)
        assert not _differ(after, wrote)
    finally:
        await sbx.close()
    assert _sha(base) == before, "the user's disk must never change"


async def test_a_qcow2_disk_boots_with_uefi_and_its_fork_has_a_disk_of_its_own(
    embedded: corral.AsyncClient, node: Node, disks: dict[str, Path]
) -> None:
    base = disks["grub-qcow2"]
    before = _sha(base)
    src = await embedded.sandboxes.create(
        kind="fullvm", image="disk:grub-qcow2", firmware="uefi", memory="512MiB",
        display_size="800x600",
    )  # fmt: skip
    copies: list[corral.AsyncSandbox] = []
    try:
        w, h, menu = await _shot(src)
        assert (w, h) == (800, 600), "OVMF should take the EDID's mode"
        assert _lit(menu) > 2000
        [copy] = copies = await embedded.sandboxes.fork(src, 1)
        _, _, copied = await _shot(copy)
        assert not _differ(copied, menu), "a copy starts from the source's screen"
        await _write_entry(src, menu)  # the source writes; the copy does not
        await src.suspend("disk")
        await copy.suspend("disk")
        assert not _same_content(_overlay(node, src.id), base)
        assert _same_content(_overlay(node, copy.id), base), "the copy got the source's write"
        await copy.resume()
        _, _, still = await _shot(copy)
        assert not _differ(still, menu)
    finally:
        for s in [src, *copies]:
            await s.close()
    assert _sha(base) == before
    assert not list(node.config.sandboxes_dir.glob(f"{src.id}/fork-*")), "fork files left"


async def test_a_disk_boots_again_with_its_own_writes_gone_for_a_new_sandbox(
    embedded: corral.AsyncClient, disks: dict[str, Path]
) -> None:
    """Each sandbox starts from the disk as added: another's write is not
    in it (GRUB's menu shows the state it read from the disk at boot)."""
    first = await embedded.sandboxes.create(kind="fullvm", image="disk:grub-raw", memory="512MiB")
    try:
        _, _, menu = await _shot(first)
        await _write_entry(first, menu)
    finally:
        await first.close()
    second = await embedded.sandboxes.create(kind="fullvm", image="disk:grub-raw", memory="512MiB")
    try:
        _, _, again = await _shot(second)
        assert not _differ(again, menu), "a new sandbox must boot the disk as it was added"
    finally:
        await second.close()


def _console(node: Node, sandbox_id: str) -> str:
    """The guest's serial port's text, terminal escapes left out (GRUB
    writes each line twice: its own and the firmware's console)."""
    log = node.config.sandboxes_dir / sandbox_id / "console.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    return re.sub(r"\x1b\[[0-9;=?]*[A-Za-z]", "", text)


async def _network_entry(node: Node, sbx: corral.AsyncSandbox) -> str:
    """Run the disk's network entry (hotkey n); its serial output."""
    before = _console(node, sbx.id).count("NETDONE")
    await sbx.display.key("n")
    deadline = time.monotonic() + 120
    while (text := _console(node, sbx.id)).count("NETDONE") == before:
        assert time.monotonic() < deadline, f"the network entry never ended: {text[-2000:]}"
        await asyncio.sleep(0.5)
    return text.split("NETDONE")[before]


async def _back_to_menu(sbx: corral.AsyncSandbox) -> None:
    """Out of the network entry's sleep; GRUB's "press any key", the menu."""
    for _ in range(2):
        await sbx.display.key("Escape")
        await asyncio.sleep(1.5)


async def _grub_lease(
    node: Node, sbx: corral.AsyncSandbox, pool: ipaddress.IPv4Network | ipaddress.IPv6Network
) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The address the network entry leased: the sandbox's (a /30's second,
    in the pool), with the host end of its /30 as router and resolver."""
    out = await _network_entry(node, sbx)
    found = re.search(r"efinet\d+:dhcp \S+ (\d+\.\d+\.\d+\.\d+)", out)
    assert found, out
    address = ipaddress.ip_address(found.group(1))
    assert address in pool and int(address) % 4 == 2, out
    gateway = address - 1
    routes, dns = out.split("dns:", 1)
    assert re.search(rf"0\.0\.0\.0/0 .*gw .*{gateway}", routes), out
    assert str(gateway) in dns, out
    return address


async def test_an_own_disk_asks_for_its_address_by_dhcp_again_after_a_resume_and_in_a_fork(
    embedded: corral.AsyncClient,
    node: Node,
    disks: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No agent tells the guest its address: its firmware's network driver
    asks by DHCP (GRUB's net_bootp over iPXE's e1000 driver) and the node
    answers with the sandbox's block: address, gateway, resolver. A name
    it looks up reaches the node's resolver (refused: the policy does not
    name it, and the sandbox's audit says so). After a suspend to disk and
    a resume (a new QEMU, a new veth) it is answered again, the same. A
    fork's copy gets an address of its own."""
    pool = ipaddress.ip_network(node.config.network_pool)
    sbx = await embedded.sandboxes.create(
        kind="fullvm", image="disk:grub-qcow2", firmware="uefi", memory="512MiB",
        display_size="800x600", network={"domains": ["example.com"]},
    )  # fmt: skip
    try:
        leases = []
        for turn in range(2):
            if turn:
                await sbx.suspend("disk")
                await sbx.resume()
                await _back_to_menu(sbx)
            leases.append(await _grub_lease(node, sbx, pool))
        assert leases[0] == leases[1]
        # A fork's copy wakes up holding this lease; its NIC is unplugged
        # and plugged back (QEMU refusing the request would fail the fork),
        # and what it asks for then gets the copy's own block.
        renewed: list[str] = []
        runtime = node.agent.parts.runtimes["fullvm"]
        real_renew = runtime.renew_link

        async def renew(sandbox_id: str) -> None:
            renewed.append(sandbox_id)
            await real_renew(sandbox_id)

        monkeypatch.setattr(runtime, "renew_link", renew)
        (copy,) = await embedded.sandboxes.fork(sbx, 1)
        try:
            assert renewed == [copy.id]
            await _back_to_menu(copy)
            assert await _grub_lease(node, copy, pool) != leases[0]
        finally:
            await copy.close()
        report = await sbx.audit()
        assert report.dns_denied_names.get("corral-denied.example", 0) >= 2, report
    finally:
        await sbx.close()


async def _console_until(
    node: Node, sandbox_id: str, pattern: str, after: int = 0
) -> re.Match[str]:
    """The first match of `pattern` in the sandbox's serial output past
    offset `after`, waited for (Linux boots in tens of seconds under TCG)."""
    deadline = time.monotonic() + 240
    while (found := re.compile(pattern).search(_console(node, sandbox_id), after)) is None:
        assert time.monotonic() < deadline, (pattern, _console(node, sandbox_id)[-3000:])
        await asyncio.sleep(0.5)
    return found


async def test_a_linux_guests_copy_sees_its_link_come_back_and_leases_its_own_address(
    embedded: corral.AsyncClient, node: Node, disks: dict[str, Path]
) -> None:
    """An OS holds its lease and asks again when its NIC's carrier comes
    back (the disk's Linux entry does as a network manager does). A
    fork's copy wakes up with its source's lease; the node unplugs its NIC
    and plugs it back once the copy's network is in place, so its guest,
    with no agent of ours, leases the copy's own address; the source keeps
    its own and sees nothing."""
    pool = ipaddress.ip_network(node.config.network_pool)
    sbx = await embedded.sandboxes.create(
        kind="fullvm", image="disk:grub-raw", memory="512MiB", display_size="800x600",
        network={},
    )  # fmt: skip
    try:
        await sbx.display.key("l")
        first = await _console_until(node, sbx.id, r"LEASE (\S+) router (\S+)")
        mine = ipaddress.ip_address(first.group(1))
        assert mine in pool and first.group(2) == str(mine - 1), first.group(0)
        (copy,) = await embedded.sandboxes.fork(sbx, 1)
        try:
            down = await _console_until(node, copy.id, r"CARRIER 0")
            # Its console is its own, begun at the load: the drop is the flap's.
            assert "LINUX UP" not in _console(node, copy.id)
            up = await _console_until(node, copy.id, r"CARRIER 1", down.end())
            lease = await _console_until(node, copy.id, r"LEASE (\S+) router (\S+)", up.end())
            theirs = ipaddress.ip_address(lease.group(1))
            assert theirs in pool and theirs != mine, lease.group(0)
            assert lease.group(2) == str(theirs - 1), lease.group(0)
        finally:
            await copy.close()
        source = _console(node, sbx.id)
        # Its boot's carrier changes and lease, and nothing since.
        assert (source.count("LEASE"), source.count("CARRIER 0")) == (1, 1), source[-2000:]
    finally:
        await sbx.close()


@contextlib.contextmanager
def _served_disk(node: Node, tmp_path: Path, name: str) -> Iterator[None]:
    """The test disk added to `node` as `name` for the block; after it, the
    node's server stopped, the disk removed, and nothing left behind."""
    if why := bootdisk.missing_tools():
        pytest.skip(why)
    _, qcow2 = bootdisk.build(tmp_path)
    node.cli("disk", "rm", name, check=False)
    node.cli("disk", "add", str(qcow2), "--name", name)
    try:
        yield
    finally:
        node.server.stop()
        node.cli("disk", "rm", name, check=False)
    assert node.leftovers() == {}


async def _networked_disk_sandbox(c: corral.AsyncClient, name: str) -> corral.AsyncSandbox:
    return await c.sandboxes.create(
        kind="fullvm", image=f"disk:{name}", firmware="uefi", memory="512MiB", network={}
    )


async def _assert_answered(node: Node, sbx: corral.AsyncSandbox) -> None:
    out = await _network_entry(node, sbx)
    assert re.search(r"efinet\d+:dhcp \S+ 10\.", out), out


async def test_the_agent_that_recovers_a_sandbox_answers_its_guests_dhcp(
    fresh_node: Node, tmp_path: Path
) -> None:
    """The agent that answered the guest's DHCP is killed (-9); the one
    started after it answers from then on."""
    srv = fresh_node.server
    with _served_disk(fresh_node, tmp_path, "grub-recover"):
        srv.start()
        async with fresh_node.http_client() as c:
            made = await _networked_disk_sandbox(c, "grub-recover")
        srv.kill(signal.SIGKILL)
        srv.start()
        async with fresh_node.http_client() as c:
            sbx = await c.sandboxes.get(made.id)
            try:
                await _assert_answered(fresh_node, sbx)
            finally:
                await sbx.close()


async def test_the_leader_answers_the_dhcp_of_a_guest_whose_agent_died(
    fresh_node: Node, tmp_path: Path
) -> None:
    """A non-leader agent that answered a guest's DHCP is killed (-9) and
    none takes its place: the node's leader answers from its next liveness
    check (the guest asks again within its lease)."""
    srv = fresh_node.server
    with _served_disk(fresh_node, tmp_path, "grub-leader"):
        # Opened first: this embedded agent leads the node.
        async with fresh_node.client() as leader:
            srv.start()
            async with fresh_node.http_client() as c:
                made = await _networked_disk_sandbox(c, "grub-leader")
            srv.kill(signal.SIGKILL)
            sbx = await leader.sandboxes.get(made.id)
            try:
                await _assert_answered(fresh_node, sbx)
            finally:
                await sbx.close()


BAD_CREATES: list[tuple[dict[str, Any], str]] = [
    ({"image": "disk:not-added"}, "image"),
    ({"image": "disk:../etc/passwd"}, "image"),
    ({"image": "disk:grub-raw", "kind": "container"}, "image"),
    ({"image": "disk:grub-raw", "kind": "microvm"}, "image"),
    ({"image": "disk:grub-raw", "firmware": "coreboot"}, "firmware"),
    ({"image": IMAGE, "firmware": "uefi"}, "firmware"),
    ({"image": "disk:grub-raw", "workspace": "ws:1"}, "workspace"),
    ({"image": "disk:grub-raw", "toolkit": ["tk:1"]}, "toolkit"),
    ({"image": "disk:grub-raw", "network": {"ecosystems": {"nosuch": True}}}, "network.ecosystems"),
]


@pytest.mark.parametrize(("change", "field"), BAD_CREATES)
async def test_bad_own_disk_creates_leave_nothing(
    client: corral.AsyncClient,
    node: Node,
    disks: dict[str, Path],
    change: dict[str, Any],
    field: str,
) -> None:
    before = (node.leftovers(), len(node.records()))
    with pytest.raises(corral.InvalidArgument) as exc:
        await client.sandboxes.create(**{"kind": "fullvm", **change})
    assert exc.value.field == field, str(exc.value)
    assert "got" in str(exc.value)
    assert (node.leftovers(), len(node.records())) == before


def test_what_is_not_a_disk_is_refused_on_add(node: Node, tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a disk\n" * 100)
    empty = tmp_path / "empty.img"
    empty.touch()
    chained = tmp_path / "chained.qcow2"
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", "/etc/passwd", str(chained)],
        check=True,
    )
    cases = [
        (text, "a raw disk starts with a boot sector"),
        (empty, "a raw disk starts with a boot sector"),
        (chained, "must not have a backing file"),
        (tmp_path, "must be a regular file"),
        (tmp_path / "absent.img", "must be a regular file"),
    ]
    for path, rule in cases:
        proc = node.cli("disk", "add", str(path), "--name", "bad", check=False)
        assert proc.returncode != 0
        assert "path" in proc.stderr and rule in proc.stderr, proc.stderr
        assert str(path.name) in proc.stderr
    bad_name = node.cli("disk", "add", str(text), "--name", "../up", check=False)
    assert bad_name.returncode != 0 and "name" in bad_name.stderr
    assert not (node.config.disks_dir / "bad").exists()
    assert not list(node.config.disks_dir.glob(".*.tmp"))
