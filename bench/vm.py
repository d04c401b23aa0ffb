"""MicroVMs and full VMs, measured next to containers in the same run:
create to agent ready, exec round trip, suspend/resume, fork of one state
into 8 VMs, virtio-pmem + DAX vs virtio-blk for N VMs reading the same
files, free page reporting, and host memory per idle VM.

    corral bench vm [--creates 10] [--execs 100] [--idle 8]

The accelerator is printed with the table: TCG on these hosts (their
/dev/kvm is nested PVM, on which a stock guest kernel hangs), KVM elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corral
from _common import IMAGE, IMAGES, fresh_dir, leak_counts, mem_used, pct, table, write_result
from corral.config import NodeConfig
from corral.runtimes.vm.qemu import accelerator

WORK = Path("/var/lib/corral-vm")


def pss(pid: int) -> int:
    """Proportional set size of a process, bytes (shared pages split)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


MEMORY = {"container": "256MiB", "microvm": "256MiB", "fullvm": "512MiB"}


def qemu_pids(sandboxes_dir: Path, boxes: list[corral.AsyncSandbox]) -> list[int]:
    # qemu.pid: "<pid> <start time> <kind>" (runtimes/vm/runtime.py)
    return [int((sandboxes_dir / s.id / "qemu.pid").read_text().split()[0]) for s in boxes]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def drop_caches() -> None:
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


async def creates(c: corral.AsyncClient, kind: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        s = await c.sandboxes.create(kind=kind, image=IMAGE, memory=MEMORY[kind], disk="256MiB")
        out.append(time.perf_counter() - t0)
        await s.close()
    return out


async def execs(c: corral.AsyncClient, kind: str, n: int) -> list[float]:
    s = await c.sandboxes.create(kind=kind, image=IMAGE, memory=MEMORY[kind], disk="256MiB")
    try:
        await s.commands.run("true")
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await s.commands.run(["true"])
            out.append(time.perf_counter() - t0)
        return out
    finally:
        await s.close()


async def snapshots(c: corral.AsyncClient, kind: str, n: int) -> list[list[str]]:
    """suspend: save to disk and stop; resume: a new QEMU loads the state and
    the agent answers. State size after a little work."""
    s = await c.sandboxes.create(kind=kind, image=IMAGE, memory=MEMORY[kind], disk="256MiB")
    sus, res, sizes = [], [], []
    try:
        await s.commands.run("python3 -c 'import json'")
        for _ in range(n):
            t0 = time.perf_counter()
            await s.suspend()
            sus.append(time.perf_counter() - t0)
            sizes.append(
                sum(f.stat().st_size for f in WORK.glob(f"sandboxes/{s.id}/vm.state")) / 2**20
            )
            t0 = time.perf_counter()
            await s.resume()
            await s.commands.run(["true"])
            res.append(time.perf_counter() - t0)
    finally:
        await s.close()

    def ms(v: list[float]) -> list[str]:
        return [f"{pct(v, 50) * 1000:.0f} ms", f"{pct(v, 99) * 1000:.0f} ms"]

    return [
        [kind, "suspend (save + stop)", str(n), *ms(sus)],
        [kind, "resume to first answer", str(n), *ms(res)],
        [kind, "state size", str(n), f"{pct(sizes, 50):.0f} MiB", f"{pct(sizes, 99):.0f} MiB"],
    ]


async def forks(c: corral.AsyncClient, n: int, sandboxes_dir: Path) -> list[list[str]]:
    """One running microVM (256 MiB, after some work) forked into n copies
    at once: the source's pause, the time until every copy answers, and the
    host memory the copies take."""
    src = await c.sandboxes.create(kind="microvm", image=IMAGE, memory="256MiB", disk="256MiB")
    try:
        await src.commands.run("python3 -c 'import json, email, http.client'")
        before = mem_used()
        t0 = time.perf_counter()
        copies = await c.sandboxes.fork(src, n)
        total = time.perf_counter() - t0
        answers = await asyncio.gather(*(x.commands.run(["true"]) for x in copies))
        assert all(a.exit_code == 0 for a in answers)
        await asyncio.sleep(2)
        used = (mem_used() - before) / n / 2**20
        pss_mib = sum(pss(p) for p in qemu_pids(sandboxes_dir, copies)) / n / 2**20
        await asyncio.gather(*(x.close() for x in copies))
        # The same number of VMs booted from scratch, for comparison.
        t0 = time.perf_counter()
        fresh = await asyncio.gather(
            *(
                c.sandboxes.create(kind="microvm", image=IMAGE, memory="256MiB", disk="256MiB")
                for _ in range(n)
            )
        )
        boot = time.perf_counter() - t0
        await asyncio.gather(*(x.close() for x in fresh))
    finally:
        await src.close()
    return [
        [f"fork into {n}", f"{total:.2f} s", f"{used:.0f}", f"{pss_mib:.0f}"],
        [f"{n} fresh boots at once", f"{boot:.2f} s", "", ""],
    ]


READ = "tar cf - /usr | wc -c"  # every file of the image's /usr, ~160 MB


async def sharing(cfg: NodeConfig, pmem: bool, n: int) -> tuple[float, float, float]:
    """n full VMs read the same files from their base layer: (host memory
    in use, QEMU PSS total, seconds for the reads), deltas over the idle VMs.
    Caches dropped first, so both modes start cold."""
    drop_caches()
    async with corral.AsyncClient(config=replace(cfg, vm_pmem=pmem)) as c:
        boxes = await asyncio.gather(
            *(
                c.sandboxes.create(kind="fullvm", image=IMAGE, memory="512MiB", disk="256MiB")
                for _ in range(n)
            )
        )
        try:
            await asyncio.sleep(3)
            pids = qemu_pids(cfg.sandboxes_dir, boxes)
            mem0, pss0 = mem_used(), sum(pss(p) for p in pids)
            t0 = time.perf_counter()
            outs = await asyncio.gather(*(b.commands.run(READ, timeout=600) for b in boxes))
            took = time.perf_counter() - t0
            assert all(o.exit_code == 0 for o in outs), outs[0]
            mem1, pss1 = mem_used(), sum(pss(p) for p in pids)
        finally:
            await asyncio.gather(*(b.close() for b in boxes))
    return (mem1 - mem0) / 2**20, (pss1 - pss0) / 2**20, took


async def free_pages(cfg: NodeConfig, reporting: bool) -> list[str]:
    """A guest touches 192 MiB, then frees it: QEMU's RSS before, at the
    peak, and 5 s after the free."""
    async with corral.AsyncClient(config=replace(cfg, vm_free_page_reporting=reporting)) as c:
        s = await c.sandboxes.create(kind="microvm", image=IMAGE, memory="512MiB", disk="256MiB")
        try:
            pid = qemu_pids(cfg.sandboxes_dir, [s])[0]
            await asyncio.sleep(2)
            idle_rss = rss(pid)
            h = await s.commands.start(
                "python3 -c 'import time; b = bytearray(192 << 20)\n"
                "for i in range(0, len(b), 4096): b[i] = 1\n"
                "time.sleep(3)'"
            )
            await asyncio.sleep(2.5)
            peak = rss(pid)
            await h.wait(60)
            await asyncio.sleep(5)
            after = rss(pid)
        finally:
            await s.close()
    return [
        "on" if reporting else "off",
        f"{idle_rss / 2**20:.0f}",
        f"{peak / 2**20:.0f}",
        f"{after / 2**20:.0f}",
        f"{(peak - after) / 2**20:.0f}",
    ]


async def idle(
    c: corral.AsyncClient, kind: str, n: int, sandboxes_dir: Path
) -> tuple[float, float, float]:
    """Host memory per idle VM: (MemAvailable drop, mean QEMU PSS, mean RSS), MiB."""
    before = mem_used()
    boxes = [
        await c.sandboxes.create(kind=kind, image=IMAGE, memory=MEMORY[kind], disk="256MiB")
        for _ in range(n)
    ]
    for s in boxes:
        await s.commands.run("python3 -c 'import json'")  # a little real work, then idle
    await asyncio.sleep(5)
    used = (mem_used() - before) / n / 2**20
    pids = qemu_pids(sandboxes_dir, boxes)
    pss_mib = sum(pss(p) for p in pids if p) / n / 2**20
    rss_total = sum(rss(p) for p in pids)
    for s in boxes:
        await s.close()
    return used, pss_mib, rss_total / n / 2**20


async def main(n_create: int, n_exec: int, n_idle: int) -> None:
    fresh_dir(WORK)
    before = leak_counts(WORK)
    cfg = NodeConfig.from_env(data_dir=WORK, images=IMAGES, node="vmb")
    accel = accelerator()
    rows, exec_rows, snap_rows, idle_rows = [], [], [], []
    async with corral.AsyncClient(config=cfg) as c:
        await creates(c, "microvm", 1)  # builds or finds the guest artefacts
        await creates(c, "fullvm", 1)  # and the base layer's pmem image
        for kind in ("container", "microvm", "fullvm"):
            n = n_create if kind != "fullvm" else max(3, n_create // 2)
            t = await creates(c, kind, n)
            rows.append([kind, str(n), f"{pct(t, 50) * 1000:.0f}", f"{pct(t, 99) * 1000:.0f}"])
            e = await execs(c, kind, n_exec)
            exec_rows.append(
                [kind, str(n_exec), f"{pct(e, 50) * 1000:.2f}", f"{pct(e, 99) * 1000:.2f}"]
            )
            print(rows[-1], exec_rows[-1], flush=True)
        for kind in ("microvm", "fullvm"):
            snap_rows += await snapshots(c, kind, 5)
        print(snap_rows, flush=True)
        fork_rows = await forks(c, 8, cfg.sandboxes_dir)
        print(fork_rows, flush=True)
        for kind, n in (("microvm", n_idle), ("fullvm", max(2, n_idle // 2))):
            used, pss_mib, rss_mib = await idle(c, kind, n, cfg.sandboxes_dir)
            idle_rows.append([kind, str(n), f"{used:.0f}", f"{pss_mib:.0f}", f"{rss_mib:.0f}"])
        print(idle_rows, flush=True)
    share_rows = []
    for n in (4, 8):
        blk = await sharing(cfg, False, n)
        pm = await sharing(cfg, True, n)
        saved = 1 - pm[0] / blk[0] if blk[0] > 0 else 0.0
        saved_pss = 1 - pm[1] / blk[1] if blk[1] > 0 else 0.0
        share_rows.append(
            [str(n), f"{blk[0]:.0f}", f"{pm[0]:.0f}", f"{saved:.1%}",
             f"{blk[1]:.0f}", f"{pm[1]:.0f}", f"{saved_pss:.1%}", f"{blk[2]:.1f} / {pm[2]:.1f}"]
        )  # fmt: skip
        print(share_rows[-1], flush=True)
    fpr_rows = [await free_pages(cfg, True), await free_pages(cfg, False)]
    print(fpr_rows, flush=True)
    after = leak_counts(WORK)
    ratio = float(rows[1][2]) / float(rows[0][2])
    full_ratio = float(rows[2][2]) / float(rows[0][2])
    sections = [
        f"## Create to agent ready (accelerator: {accel})\n\n"
        "Sequential creates of `debian-python:bookworm` (256 MiB; a full VM 512 MiB; 256 MiB "
        "disk). A microVM boots Debian's 6.1 kernel (uncompressed vmlinux, PVH entry), loads its "
        "modules, mounts the image's EROFS layers from virtio-blk drives under an overlay, and "
        "its agent answers on a virtio-serial port. A full VM is q35 (PCI, firmware) with a "
        "VGA, tablet and keyboard, and its base layer on virtio-pmem with DAX.\n\n"
        + table(["kind", "creates", "p50 (ms)", "p99 (ms)"], rows)
        + f"\n\nmicroVM / container, p50: {ratio:.1f}x; full VM / container: {full_ratio:.1f}x.",
        "## Exec round trip (`true`)\n\n"
        "A VM's request crosses the host multiplexer, QEMU's chardev and the guest's "
        "virtio-serial port; a container's goes straight to its init's socket.\n\n"
        + table(["kind", "runs", "p50 (ms)", "p99 (ms)"], exec_rows),
        "## Suspend and resume (QMP migrate to a file; a new QEMU with `-incoming`)\n\n"
        + table(["kind", "what", "rounds", "p50", "p99"], snap_rows),
        "## Fork: one running microVM's state loaded into 8 new VMs\n\n"
        "`client.sandboxes.fork(src, 8)`: the source is saved once (it pauses for that), "
        "8 QEMUs load the state at once; timed until all 8 answer. Beside it, 8 fresh boots "
        "at once on the same machine.\n\n"
        + table(
            ["what", "time", "host memory per copy (MiB)", "QEMU PSS per copy (MiB)"], fork_rows
        ),
        f"## Shared base image: virtio-pmem + DAX vs virtio-blk ({accel})\n\n"
        f"N full VMs (512 MiB each) run `{READ}` at once: every file of the same base layer. "
        "Host memory is the growth of MemTotal - MemAvailable over the reads (page caches "
        "dropped before each run, so both start cold): the host's page cache is reclaimable "
        "and not counted, neither the one copy pmem maps nor the lazy loader's under blk. PSS "
        "is the QEMUs' proportional set size: it counts the mapped pmem pages, each shared "
        "page 1/N to each of the N VMs. With virtio-blk each guest "
        "keeps its own copy of every page it read in its page cache; with pmem + DAX every "
        "guest maps the one host copy.\n\n"
        + table(
            [
                "VMs",
                "blk: host MiB",
                "pmem: host MiB",
                "saved",
                "blk: PSS MiB",
                "pmem: PSS MiB",
                "saved (PSS)",
                "read time blk / pmem (s)",
            ],
            share_rows,
        )
        + "\n\nTarget: at least 40% less host memory (DSec: 40.2% less at peak).",
        "## Free page reporting\n\n"
        "A microVM (512 MiB) touches 192 MiB in a process that then exits; QEMU's RSS, MiB. "
        "With reporting on, the guest hands freed pages back (virtio-balloon) and the host "
        "drops them.\n\n"
        + table(
            ["reporting", "idle RSS", "peak RSS", "RSS 5 s after the free", "given back"], fpr_rows
        ),
        f"## Host memory per idle VM ({accel})\n\n"
        + table(
            [
                "kind",
                "VMs at once",
                "host memory in use, per VM (MiB)",
                "QEMU PSS per VM (MiB)",
                "RSS (MiB)",
            ],
            idle_rows,
        ),
        "## Leftovers (host-wide, before vs after)\n\n"
        + table(["object", "before", "after"], [[k, str(before[k]), str(after[k])] for k in after]),
    ]
    path = write_result("vm", "MicroVMs and full VMs next to containers", sections)
    print(f"wrote {path}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--creates", type=int, default=10)
    ap.add_argument("--execs", type=int, default=100)
    ap.add_argument("--idle", type=int, default=8)
    a = ap.parse_args()
    asyncio.run(main(a.creates, a.execs, a.idle))
