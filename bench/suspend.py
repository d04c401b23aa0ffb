"""Suspend and resume, and the trajectory log, side by side with their
peers in one run.

    corral bench suspend [--quick]

- freeze: sbx.suspend() / sbx.resume() of an idle container, p50/p99, next
  to the bare cgroup freezer write on the same cgroup (what `crun pause`
  and `runc pause` do) in the same run;
- VMs: a microVM's suspend to disk and resume (QMP migration) and its
  freeze (vCPUs stopped), the same way;
- host memory held by N frozen containers vs N running idle ones, and by
  containers each holding 50 MiB resident, with the node's swap file;
- the trajectory log: a recorded step, and commands.run through a rollout
  vs the same call without one (embedded, p50/p99 per step).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corral
from _common import IMAGE, IMAGES, mem_used, pct, table, timed, write_result
from corral.config import NodeConfig
from corral.runtimes.container import criu

DATA = Path("/var/lib/corral-suspend")
HOLD = (
    'python3 -c "\nimport time\nx=bytearray(50<<20)\n'
    'for i in range(0,len(x),4096): x[i]=1\ntime.sleep(100000)"'
)


def _ms(xs: list[float]) -> tuple[str, str]:
    return f"{pct(xs, 50) * 1000:.2f}", f"{pct(xs, 99) * 1000:.2f}"


def _config(swap: bool) -> NodeConfig:
    cfg = NodeConfig.from_env(data_dir=DATA, images=IMAGES, node="sus", memory_overcommit=8.0)
    return replace(cfg, swap_size=8 << 30) if swap else cfg


async def freeze_latency(c: corral.AsyncClient, n: int) -> list[str]:
    sbx = await c.sandboxes.create(image=IMAGE, memory="128MiB")
    snaps = c._service.parts.snapshots  # type: ignore[attr-defined]
    cg = c._service.parts.cgroups  # type: ignore[attr-defined]
    sus, res = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        await sbx.suspend()
        sus.append(time.perf_counter() - t0)
        await snaps.settled(sbx.id)
        t0 = time.perf_counter()
        await sbx.resume()
        res.append(time.perf_counter() - t0)
    bare_f, bare_t = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        await cg.freeze(sbx.id)
        bare_f.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        await cg.thaw(sbx.id)
        bare_t.append(time.perf_counter() - t0)
    # The first request after a suspend resumes on its way (what a trainer sees).
    wake = []
    for _ in range(n):
        await sbx.suspend()
        await snaps.settled(sbx.id)
        t0 = time.perf_counter()
        await sbx.commands.run("true")
        wake.append(time.perf_counter() - t0)
    plain = await timed(n, lambda: sbx.commands.run("true"))
    await sbx.close()
    rows = [
        ["Corral suspend(freeze)", *_ms(sus), f"{pct(sus, 50) / pct(bare_f, 50):.1f}x"],
        ["bare cgroup freeze (crun/runc pause)", *_ms(bare_f), "1.0x"],
        ["Corral resume (thaw)", *_ms(res), f"{pct(res, 50) / pct(bare_t, 50):.1f}x"],
        ["bare cgroup thaw (crun/runc resume)", *_ms(bare_t), "1.0x"],
        [
            "first command after a freeze (resumes)",
            *_ms(wake),
            f"{pct(wake, 50) / pct(plain, 50):.1f}x",
        ],
        ["the same command, running", *_ms(plain), "1.0x"],
    ]
    return [
        f"## Freeze: an idle container, {n} times each\n",
        table(["what", "p50 ms", "p99 ms", "vs peer (p50)"], rows),
    ]


def _bare_criu(n: int) -> tuple[list[float], list[float], int]:
    """The peer: `criu dump` / `criu restore` of a bare process holding
    50 MiB (no container, no namespaces), n times."""
    import ctypes
    import shutil
    import subprocess
    import tempfile

    # Restored processes re-parent to us, and are reaped at once after each
    # dump (this host's PID 1 reaps late; a pid not yet freed fails the
    # next restore with EEXIST).
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    d = Path(tempfile.mkdtemp(prefix="criu-peer-"))
    hold = ["python3", "-c", "import time\nx=bytearray(50<<20)\n"
            "for i in range(0,len(x),4096): x[i]=1\ntime.sleep(100000)"]  # fmt: skip
    proc = subprocess.Popen(hold, start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    time.sleep(1.5)
    pid, dumps, restores, size = proc.pid, [], [], 0
    for _ in range(n):
        img = d / "img"
        shutil.rmtree(img, ignore_errors=True)
        img.mkdir()
        t0 = time.perf_counter()
        subprocess.run([criu.CRIU, "dump", "-t", str(pid), "-D", str(img), "-o", "d.log"],
                       check=True)  # fmt: skip
        dumps.append(time.perf_counter() - t0)
        os.waitpid(pid, 0)
        size = sum(p.stat().st_size for p in img.iterdir())
        (d / "pid").unlink(missing_ok=True)
        t0 = time.perf_counter()
        subprocess.run([criu.CRIU, "restore", "-D", str(img), "-o", "r.log", "-d",
                        "--pidfile", str(d / "pid")], check=True)  # fmt: skip
        restores.append(time.perf_counter() - t0)
        pid = int((d / "pid").read_text())
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    shutil.rmtree(d, ignore_errors=True)
    return dumps, restores, size


async def disk_latency(c: corral.AsyncClient, n: int) -> list[str]:
    if criu.available():
        return [f"## To disk\n\nnot measured: {criu.available()}"]
    rows = []
    sizes = []
    for hold in (False, True):
        sbx = await c.sandboxes.create(image=IMAGE, memory="256MiB")
        if hold:
            await sbx.commands.run(f"nohup {HOLD} >/dev/null 2>&1 &")
            await asyncio.sleep(3)
        sus, res = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            await sbx.suspend("disk")
            sus.append(time.perf_counter() - t0)
            img = DATA / "sandboxes" / sbx.id / "checkpoint" / "img"
            ckpt = sum(p.stat().st_size for p in img.iterdir())
            t0 = time.perf_counter()
            await sbx.resume()
            res.append(time.perf_counter() - t0)
        what = "holding 50 MiB" if hold else "idle"
        rows += [[f"Corral suspend(disk), {what}", *_ms(sus)],
                 [f"Corral resume from disk, {what}", *_ms(res)]]  # fmt: skip
        sizes.append(f"{what}: {ckpt / 2**20:.1f} MiB")
        await sbx.close()
    dumps, restores, size = await asyncio.to_thread(_bare_criu, n)
    rows += [["bare criu dump, a process holding 50 MiB", *_ms(dumps)],
             ["bare criu restore, the same", *_ms(restores)]]  # fmt: skip
    return [
        f"## To disk (CRIU): a container, {n} times each, next to bare CRIU\n",
        table(["what", "p50 ms", "p99 ms"], rows),
        f"\nCheckpoint size: {'; '.join(sizes)}; bare CRIU's image of the 50 MiB process: "
        f"{size / 2**20:.1f} MiB.",
    ]


async def moving(c: corral.AsyncClient, n: int) -> list[str]:
    """A container with 50 MiB resident: forked into 2 copies, saved to the
    shared store, restored on a second node of this machine."""
    if criu.available():
        return [f"## Checkpoints that move\n\nnot measured: {criu.available()}"]
    other = replace(_config(swap=False), data_dir=DATA.with_name(DATA.name + "-b"), node="susb")
    forks, saves, restores = [], [], []
    size = 0
    async with corral.AsyncClient(config=other) as b:
        for _ in range(n):
            sbx = await c.sandboxes.create(image=IMAGE, memory="256MiB")
            await sbx.commands.run(f"nohup {HOLD} >/dev/null 2>&1 &")
            await asyncio.sleep(2)
            t0 = time.perf_counter()
            copies = await c.sandboxes.fork(sbx, 2)
            forks.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            saved = await sbx.save()
            saves.append(time.perf_counter() - t0)
            size = saved.size
            t0 = time.perf_counter()
            moved = await b.sandboxes.restore(saved)
            restores.append(time.perf_counter() - t0)
            await asyncio.gather(*(x.close() for x in [moved, *copies, sbx]))
    return [
        f"## Checkpoints that move: a container holding 50 MiB, {n} times each\n",
        table(
            ["what", "p50 ms", "p99 ms"],
            [
                ["fork into 2 copies (the source pauses, both copies running)", *_ms(forks)],
                ["save to the store (suspend to disk + pack + upload)", *_ms(saves)],
                ["restore on another node (download, check, create, CRIU)", *_ms(restores)],
            ],
        ),
        f"\nThe saved checkpoint: {size / 2**20:.1f} MiB (images and writable layer).",
    ]


async def vm_latency(c: corral.AsyncClient, n: int) -> list[str]:
    try:
        sbx = await c.sandboxes.create(kind="microvm", image=IMAGE, memory="256MiB")
    except corral.CorralError as exc:
        return [f"## microVM\n\nnot measured: {exc}"]
    rows = []
    for mode in ("disk", "freeze"):
        sus, res = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            await sbx.suspend(mode)
            sus.append(time.perf_counter() - t0)
            await c._service.parts.snapshots.settled(sbx.id)  # type: ignore[attr-defined]
            t0 = time.perf_counter()
            await sbx.resume()
            res.append(time.perf_counter() - t0)
            await sbx.commands.run("true")
        rows += [[f"suspend({mode})", *_ms(sus)], [f"resume from {mode}", *_ms(res)]]
    await sbx.close()
    return [
        f"## microVM (256 MiB guest, TCG), {n} times each\n",
        table(["what", "p50 ms", "p99 ms"], rows),
    ]


async def _settle(c: corral.AsyncClient, ids: list[str]) -> None:
    snaps = c._service.parts.snapshots  # type: ignore[attr-defined]
    await asyncio.gather(*(snaps.settled(i) for i in ids))
    await asyncio.sleep(1)


async def memory(c: corral.AsyncClient, n: int, hold: bool) -> list[str]:
    cg = c._service.parts.cgroups  # type: ignore[attr-defined]
    job = f"mem{int(hold)}"
    base = mem_used()
    made = await c.sandboxes.create_many(
        {
            "image": IMAGE,
            "memory": "96MiB" if hold else "32MiB",
            "labels": {"job": job},
            "idle_timeout": None,
        },
        n,
        concurrency=8,
    )
    sbxs = [s for s in made if isinstance(s, corral.AsyncSandbox)]
    if hold:
        await asyncio.gather(*(s.commands.start(HOLD) for s in sbxs))
        await asyncio.sleep(5)
    await asyncio.sleep(2)
    running = mem_used() - base
    cg_running = sum(cg.memory_usage(s.id) or 0 for s in sbxs)
    t0 = time.perf_counter()
    out = await c.sandboxes.suspend_many({"job": job}, concurrency=32)
    took = time.perf_counter() - t0
    await _settle(c, [s.id for s in sbxs])
    frozen = mem_used() - base
    cg_frozen = sum(cg.memory_usage(s.id) or 0 for s in sbxs)
    t0 = time.perf_counter()
    await c.sandboxes.resume_many({"job": job}, concurrency=32)
    back = time.perf_counter() - t0
    await asyncio.gather(*(s.close() for s in sbxs))
    what = "holding 50 MiB resident each" if hold else "idle"
    mib = 2**20
    return [
        f"## Host memory: {len(sbxs)} containers {what}, running vs frozen\n",
        table(
            ["", "running", "frozen", "frozen / running"],
            [
                [
                    "host memory in use (MemTotal - MemAvailable), MiB",
                    f"{running / mib:.0f}",
                    f"{frozen / mib:.0f}",
                    f"{frozen / max(running, 1):.2f}",
                ],
                [
                    "their cgroups' memory, MiB",
                    f"{cg_running / mib:.0f}",
                    f"{cg_frozen / mib:.0f}",
                    f"{cg_frozen / max(cg_running, 1):.2f}",
                ],
                [
                    "per sandbox, MiB (host)",
                    f"{running / len(sbxs) / mib:.2f}",
                    f"{frozen / len(sbxs) / mib:.2f}",
                    "",
                ],
            ],
        ),
        f"\nsuspend_many of {len(sbxs)}: {took:.2f} s ({sum(o.ok for o in out)} ok); "
        f"resume_many: {back:.2f} s. Host memory is counted from a baseline taken before "
        "the creates: below 0, the freezes' reclaim also pushed out page cache that was "
        "there before; the cgroup line is the sandboxes' own memory.",
    ]


async def log_overhead(c: corral.AsyncClient, n: int) -> list[str]:
    r = await c.rollouts.open()
    sbx = await r.create(image=IMAGE, memory="64MiB")
    plain = await timed(n, lambda: sbx.sandbox.commands.run("true"))
    logged = await timed(n, lambda: sbx.commands.run("true"))
    keyed_i = iter(range(10**9))
    keyed = await timed(n, lambda: sbx.sandbox.commands.run("true", key=f"k{next(keyed_i)}"))
    rec = await timed(n, lambda: r.record("policy", lambda: 1))
    name = r.name
    t0 = time.perf_counter()
    replay = await c.rollouts.open(name)
    again = await replay.create(image=IMAGE, memory="64MiB")
    for _ in range(n):
        await again.commands.run("true")
    ff = (time.perf_counter() - t0) / (n + 1)
    await sbx.sandbox.close()
    await c.rollouts.delete(name)
    added = statistics.median(logged) - statistics.median(plain)
    return [
        f"## The trajectory log, embedded, {n} steps each\n",
        table(
            ["call", "p50 ms", "p99 ms"],
            [
                ["commands.run('true')", *_ms(plain)],
                ["the same with a key (run at most once)", *_ms(keyed)],
                ["the same as a rollout step (key + log)", *_ms(logged)],
                ["a recorded value (rollout.record)", *_ms(rec)],
            ],
        ),
        f"\nAdded per command step (p50): {added * 1000:.2f} ms. "
        f"Fast-forward through a logged step: {ff * 1000:.3f} ms.",
    ]


async def main(quick: bool) -> None:
    n = 20 if quick else 200
    count = 50 if quick else 500
    sections: list[str] = []
    async with corral.AsyncClient(config=_config(swap=False)) as c:
        sections += await freeze_latency(c, n)
        sections += await log_overhead(c, n)
        sections += await disk_latency(c, 5 if quick else 20)
        sections += await moving(c, 3 if quick else 10)
        sections += await vm_latency(c, 3 if quick else 10)
    async with corral.AsyncClient(config=_config(swap=True)) as c:
        sections += await memory(c, count, hold=False)
        sections += await memory(c, 10 if quick else 50, hold=True)
    path = write_result("suspend", "Suspend, resume and the trajectory log", sections)
    print(path.read_text())


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    asyncio.run(main(ap.parse_args().quick))
