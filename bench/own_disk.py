"""A user's own disk on a full VM (docs/own-disk.md) next to bare QEMU
booting the same disk on the same devices, in one run: boot to the first
screen with BIOS and UEFI, fork, suspend and resume, screenshots and
keys, host memory per idle sandbox, what the overlay holds, and the
guest's DHCP (GRUB's net_bootp, UEFI) answered by the node against QEMU's
own user-mode network (slirp's DHCP) on the same NIC, and a networked
fork's copy getting its own address (the disk's Linux entry: the node
unplugs and plugs back the copy's NIC) against the same unplug on bare
QEMU with slirp.

The disk is the tests' (tests/framework/bootdisk.py: GRUB's menu, raw).
Bare QEMU is DiskVM's own command line over a fresh overlay, polled
through QMP until its screen stops changing; "menu on screen" is when
the final frame first appeared. Corral's create returns when the screen
has held still for owndisk.QUIET seconds (no agent can say more), so
its "menu on screen" is the create's time less that.

    corral bench own_disk [--creates 5] [--n 40] [--idle 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from tests.framework import bootdisk  # noqa: E402

import corral  # noqa: E402
from _common import fresh_dir, leak_counts, mem_used, pct, table, timed, write_result  # noqa: E402
from corral.config import NodeConfig  # noqa: E402
from corral.images.disks import Disks  # noqa: E402
from corral.runtimes.drawn import STILL_ROWS  # noqa: E402
from corral.runtimes.vm import owndisk, pixels  # noqa: E402
from corral.runtimes.vm.qemu import NETDEV, OVMF_VARS, DiskVM, accelerator  # noqa: E402
from corral.runtimes.vm.qmp import Qmp  # noqa: E402
from corral.runtimes.vm.runtime import LINK_DOWN  # noqa: E402

WORK = Path("/var/lib/corral-own-disk")
SIZE = (1024, 768)
FIRMWARES = ("bios", "uefi")


async def bare_boot(disk: Path, firmware: str, work: Path) -> float:
    """Seconds from QEMU's start to its final screen's first frame."""
    fresh_dir(work)
    overlay = work / "o.qcow2"
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(disk), "-F", "raw", str(overlay)],
        check=True,
    )
    vars_ = None
    if firmware == "uefi":
        vars_ = work / "vars.fd"
        vars_.write_bytes(OVMF_VARS.read_bytes())
    vm = DiskVM(
        overlay, work / "console.log", work / "qmp.sock", work / "vnc.sock", SIZE,
        memory_mib=512, vars=vars_, accel=accelerator(),
    )  # fmt: skip
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *vm.argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    frames: list[tuple[float, pixels.Rgb]] = []
    try:
        qmp = await Qmp.connect(work / "qmp.sock", timeout=10)
        try:
            last_change = time.perf_counter()
            while time.perf_counter() - last_change < owndisk.QUIET:
                await qmp.execute("screendump", filename=str(work / "s.ppm"))
                now = time.perf_counter()
                frame = pixels.parse_ppm((work / "s.ppm").read_bytes())
                if not frames or pixels.rows_changed(frame, frames[-1][1]) > STILL_ROWS:
                    last_change = now
                frames.append((now - t0, frame))
                await asyncio.sleep(0.05)
        finally:
            qmp.close()
    finally:
        proc.kill()
        await proc.wait()
    final = frames[-1][1]
    first = next(t for t, f in frames if pixels.rows_changed(f, final) <= STILL_ROWS)
    return first


LEASED = "efinet0:dhcp"  # what GRUB's net_ls_addr prints once net_bootp has an address


async def _serial_has(log: Path, text: str, after: int = 0, timeout: float = 120) -> None:
    deadline = time.perf_counter() + timeout
    while text not in log.read_text(errors="replace")[after:]:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{text!r} never on {log}")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def _bare_on_slirp(disk: Path, work: Path) -> AsyncIterator[tuple[Path, Qmp]]:
    """Bare QEMU, UEFI, the same e1000 on QEMU's user-mode network, at
    GRUB's menu: (its serial log, its QMP); ended after."""
    fresh_dir(work)
    overlay = work / "o.qcow2"
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(disk), "-F", "raw", str(overlay)],
        check=True,
    )
    vars_ = work / "vars.fd"
    vars_.write_bytes(OVMF_VARS.read_bytes())
    log = work / "console.log"
    log.touch()
    vm = DiskVM(
        overlay, log, work / "qmp.sock", work / "vnc.sock", SIZE, memory_mib=512, vars=vars_,
        accel=accelerator(),
    )  # fmt: skip
    argv = [*vm.argv(), "-netdev", f"user,id={NETDEV}",
            "-device", f"e1000,netdev={NETDEV},bootindex=1"]  # fmt: skip
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        await _serial_has(log, "Corral disk: network")
        await asyncio.sleep(1)
        qmp = await Qmp.connect(work / "qmp.sock", timeout=10)
        try:
            yield log, qmp
        finally:
            qmp.close()
    finally:
        proc.kill()
        await proc.wait()


async def bare_dhcp(disk: Path, work: Path) -> float:
    """Bare QEMU on user-mode networking: seconds from the key that runs the
    disk's network entry to its address."""
    async with _bare_on_slirp(disk, work) as (log, qmp):
        mark = len(log.read_text(errors="replace"))
        t0 = time.perf_counter()
        await qmp.execute("send-key", keys=[{"type": "qcode", "data": "n"}])
        await _serial_has(log, LEASED, mark)
        return time.perf_counter() - t0


async def corral_dhcp(c: corral.AsyncClient, cfg: NodeConfig) -> float:
    """The same through Corral: the node's DHCP, over the sandbox's veth."""
    s = await c.sandboxes.create(
        kind="fullvm", image="disk:bench", firmware="uefi", memory="512MiB", network={}
    )
    try:
        log = cfg.sandboxes_dir / s.id / "console.log"
        mark = len(log.read_text(errors="replace"))
        t0 = time.perf_counter()
        await s.display.key("n")
        await _serial_has(log, LEASED, mark)
        return time.perf_counter() - t0
    finally:
        await s.close()


LINUX_LEASE = "LEASE "  # the disk's Linux entry got an address (bootdisk.LEASE_SCRIPT)


async def bare_relink(disk: Path, work: Path, n: int) -> list[float]:
    """Bare QEMU on user-mode networking, the disk's Linux entry: seconds
    from the NIC plugged back (QMP set_link, after the same unplug the
    node makes) to the guest's new lease, `n` times."""
    out = []
    async with _bare_on_slirp(disk, work) as (log, qmp):
        await qmp.execute("send-key", keys=[{"type": "qcode", "data": "l"}])
        await _serial_has(log, LINUX_LEASE, timeout=300)
        for _ in range(n):
            mark = len(log.read_text(errors="replace"))
            await qmp.execute("set_link", name=NETDEV, up=False)
            await asyncio.sleep(LINK_DOWN)
            await qmp.execute("set_link", name=NETDEV, up=True)
            t0 = time.perf_counter()
            await _serial_has(log, LINUX_LEASE, mark)
            out.append(time.perf_counter() - t0)
    return out


async def corral_relink(c: corral.AsyncClient, cfg: NodeConfig, n: int) -> dict[str, list[float]]:
    """Through Corral: a networked source running the disk's Linux entry,
    forked `n` times; each fork's time, and from its return to its copy's
    own lease."""
    s = await c.sandboxes.create(
        kind="fullvm", image="disk:bench", firmware="uefi", memory="512MiB", network={}
    )
    forks, leases = [], []
    try:
        await s.display.key("l")
        await _serial_has(cfg.sandboxes_dir / s.id / "console.log", LINUX_LEASE, timeout=300)
        for _ in range(n):
            t0 = time.perf_counter()
            [copy] = await c.sandboxes.fork(s, 1)
            t1 = time.perf_counter()
            await _serial_has(cfg.sandboxes_dir / copy.id / "console.log", LINUX_LEASE)
            forks.append(t1 - t0)
            leases.append(time.perf_counter() - t1)
            await copy.close()
    finally:
        await s.close()
    return {"fork": forks, "lease": leases}


async def measure(c: corral.AsyncClient, cfg: NodeConfig, a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fw in FIRMWARES:
        spec: dict[str, Any] = {
            "kind": "fullvm",
            "image": "disk:bench",
            "firmware": fw,
            "memory": "512MiB",
        }
        creates, bare = [], []
        for _ in range(a.creates):
            t0 = time.perf_counter()
            s = await c.sandboxes.create(**spec)
            creates.append(time.perf_counter() - t0)
            await s.close()
            bare.append(await bare_boot(cfg.disks_dir / "bench", fw, WORK / "bare"))
            print(f"{fw}: create {creates[-1]:.2f}s, bare to menu {bare[-1]:.2f}s", flush=True)
        out[fw] = {"create": creates, "bare": bare}

    dhcp, dhcp_bare = [], []
    for _ in range(a.creates):
        dhcp.append(await corral_dhcp(c, cfg))
        dhcp_bare.append(await bare_dhcp(cfg.disks_dir / "bench", WORK / "bare"))
        print(f"dhcp: corral {dhcp[-1]:.2f}s, bare (slirp) {dhcp_bare[-1]:.2f}s", flush=True)
    out.update(dhcp=dhcp, dhcp_bare=dhcp_bare)
    relink = await corral_relink(c, cfg, a.creates)
    out.update(net_fork=relink["fork"], net_lease=relink["lease"])
    out["relink_bare"] = await bare_relink(cfg.disks_dir / "bench", WORK / "bare", a.creates)
    print(f"networked fork: {relink}, bare relink {out['relink_bare']}", flush=True)

    spec = {"kind": "fullvm", "image": "disk:bench", "memory": "512MiB"}
    s = await c.sandboxes.create(**spec)
    d = s.display
    out["shot"] = await timed(a.n, d.screenshot)
    out["shot50"] = await timed(a.n, lambda: d.screenshot(scale=0.5))
    out["key"] = await timed(a.n, lambda: d.key("shift"))
    out["click"] = await timed(a.n, lambda: d.click(100, 100))
    forks, suspends, resumes = [], [], []
    for _ in range(a.creates):
        t0 = time.perf_counter()
        [copy] = await c.sandboxes.fork(s, 1)
        forks.append(time.perf_counter() - t0)
        await copy.close()
        t0 = time.perf_counter()
        await s.suspend("disk")
        suspends.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await s.resume()
        resumes.append(time.perf_counter() - t0)
    out.update(fork=forks, suspend=suspends, resume=resumes)
    await s.close()

    before = mem_used()
    idle = [await c.sandboxes.create(**spec) for _ in range(a.idle)]
    await asyncio.sleep(10)
    out["mem"] = (mem_used() - before) / a.idle
    out["pss"] = sum(_pss(cfg, b.id) for b in idle) / a.idle
    out["overlay"] = sum(_overlay_bytes(cfg, b.id) for b in idle) / a.idle
    for b in idle:
        await b.close()
    return out


def _pss(cfg: NodeConfig, sandbox_id: str) -> int:
    pid = int((cfg.sandboxes_dir / sandbox_id / "qemu.pid").read_text().split()[0])
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def _overlay_bytes(cfg: NodeConfig, sandbox_id: str) -> int:
    own = owndisk.OwnDisk.of(cfg.sandboxes_dir / sandbox_id)
    assert own is not None
    return own.overlay.stat().st_blocks * 512


async def main(a: argparse.Namespace) -> None:
    fresh_dir(WORK)
    raw, _ = bootdisk.build(WORK / "disk")
    cfg = NodeConfig.from_env(data_dir=WORK / "node", node="owndisk")
    Disks(cfg.disks_dir).add(raw, "bench")
    before = leak_counts(WORK)
    async with corral.AsyncClient(config=cfg) as c:
        r = await measure(c, cfg, a)
    after = leak_counts(WORK)

    def boot_rows(fw: str) -> list[list[str]]:
        create, bare = r[fw]["create"], r[fw]["bare"]
        drawn = [x - owndisk.QUIET for x in create]
        return [
            [f"{fw}: Corral create returns (menu + {owndisk.QUIET:.0f} s still)",
             f"{pct(create, 50):.2f}", f"{pct(create, 99):.2f}", ""],
            [f"{fw}: Corral, menu on screen (create less the stillness)",
             f"{pct(drawn, 50):.2f}", f"{pct(drawn, 99):.2f}",
             f"{pct(drawn, 50) / pct(bare, 50):.2f}x"],
            [f"{fw}: bare QEMU, same disk and devices: menu on screen",
             f"{pct(bare, 50):.2f}", f"{pct(bare, 99):.2f}", "1.00x"],
        ]  # fmt: skip

    def ms(key: str) -> list[str]:
        return [f"{pct(r[key], 50) * 1000:.1f}", f"{pct(r[key], 99) * 1000:.1f}"]

    dhcp, bare_dhcp_s = r["dhcp"], r["dhcp_bare"]
    dhcp_rows = [
        ["Corral: the node's DHCP over the veth", f"{pct(dhcp, 50):.2f}", f"{pct(dhcp, 99):.2f}",
         f"{pct(dhcp, 50) / pct(bare_dhcp_s, 50):.2f}x"],
        ["bare QEMU, user-mode network (slirp's DHCP)", f"{pct(bare_dhcp_s, 50):.2f}",
         f"{pct(bare_dhcp_s, 99):.2f}", "1.00x"],
    ]  # fmt: skip
    nf, nl, rb = r["net_fork"], r["net_lease"], r["relink_bare"]
    relink_rows = [
        ["Corral: fork, 1 copy (its NIC unplugged for LINK_DOWN, then plugged back)",
         f"{pct(nf, 50):.2f}", f"{pct(nf, 99):.2f}", ""],
        ["Corral: the fork's return to the copy's own lease (the node's DHCP)",
         f"{pct(nl, 50):.2f}", f"{pct(nl, 99):.2f}", f"{pct(nl, 50) / pct(rb, 50):.2f}x"],
        ["bare QEMU: NIC plugged back to the new lease (slirp's DHCP)",
         f"{pct(rb, 50):.2f}", f"{pct(rb, 99):.2f}", "1.00x"],
    ]  # fmt: skip
    sections = [
        f"## Boot to the first screen (s; {a.creates} each; accelerator: {accelerator()})\n\n"
        "GRUB's menu from a raw disk (tests/framework/bootdisk.py), 1024x768 asked (BIOS "
        "draws GRUB in VGA text mode, 720x400; UEFI in the EDID's mode). With no agent "
        f"inside, create returns once the screen has held still {owndisk.QUIET:.0f} s "
        "(docs/own-disk.md).\n\n"
        + table(
            ["", "p50", "p99", "vs bare"],
            [row for fw in FIRMWARES for row in boot_rows(fw)],
        ),
        f"## The guest's DHCP (s; {a.creates} each; UEFI)\n\n"
        "From the key that runs the disk's network entry to GRUB's address on the serial "
        "port: GRUB's `net_bootp` over iPXE's e1000 driver (its DISCOVER, the OFFER, its "
        "REQUEST, the ACK), then `net_ls_addr`. Corral: the node answers on the sandbox's "
        "veth (guard/dhcp.py), under its egress policy. Bare: the same disk and NIC on "
        "QEMU's user-mode network, whose own DHCP answers inside QEMU.\n\n"
        + table(["", "p50", "p99", "vs bare"], dhcp_rows),
        f"## A networked fork's copy gets its own address (s; {a.creates} each; UEFI)\n\n"
        "The disk's Linux entry (Debian's kernel, e1000, busybox's udhcpc run whenever the "
        "carrier comes up, as a network manager does) holds a lease; the copy wakes up "
        f"holding it. The node unplugs the copy's NIC for {LINK_DOWN:g} s once the copy's "
        "network is in place (part of the fork), then plugs it back; the guest asks again "
        "and gets the copy's own address. Bare: the same unplug on QEMU's user-mode network.\n\n"
        + table(["", "p50", "p99", "vs bare"], relink_rows),
        f"## Operations (ms, {a.n} each; forks and suspends {a.creates} each)\n\n"
        + table(
            ["", "p50", "p99"],
            [
                ["screenshot, whole", *ms("shot")],
                ["screenshot, 50% scaled", *ms("shot50")],
                ["key (shift)", *ms("key")],
                ["click", *ms("click")],
                ["fork, 1 copy (memory saved, overlay copied, copy loaded)", *ms("fork")],
                ["suspend to disk (overlay flushed, QEMU ended)", *ms("suspend")],
                ["resume", *ms("resume")],
            ],
        ),
        f"## Host memory per idle sandbox ({a.idle} held, 10 s after drawn; 512 MiB guests)\n\n"
        + table(
            ["", "MiB"],
            [
                ["MemAvailable drop per sandbox", f"{r['mem'] / 2**20:.0f}"],
                ["PSS of its QEMU", f"{r['pss'] / 2**20:.0f}"],
                ["its overlay on disk (the disk itself is shared)", f"{r['overlay'] / 2**20:.2f}"],
            ],
        ),
        "## Leftovers\n\n"
        + table(
            ["object", "before", "after"], [[k, str(before[k]), str(after[k])] for k in before]
        ),
    ]
    print(write_result("own-disk", "A user's own disk on a full VM, next to bare QEMU", sections))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--creates", type=int, default=5)
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--idle", type=int, default=3)
    asyncio.run(main(ap.parse_args()))
