"""Function calls, side by side with a fresh bwrap and a fresh `crun run`
per call doing the same job, in one run.

    corral bench fncall [--quick]

The job: python3 printing 1 in an isolated, read-only copy of the function
image with a private /tmp (and, for Corral, /work), as an unprivileged user. Corral serves
it from its warm pool (embedded client; each call writes main.py, runs it,
and the worker is reset after). The peers start fresh each call: bwrap
(namespaces only: no cgroup limits, no seccomp) and crun run (namespaces,
cgroup limits; no seccomp, no user namespace), both over the image's EROFS
layer mounted read-only. Also: a C++ compile-and-run with the compile and
run costs apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corral
from _common import IMAGES, fresh_dir, median, pct, table, write_result
from corral.config import NodeConfig
from corral.images.mounter import LayerMounts
from corral.images.store import ImageStore
from corral.runtimes.container import bundle

DATA = Path("/var/lib/corral-fncall")
PEER = Path("/var/lib/corral-fncall-peer")
IMAGE = "fncall:bookworm"
WORKERS = 8
CPP = """#include <algorithm>
#include <iostream>
#include <vector>
int main() {
    std::vector<long> v;
    for (long i = 0; i < 100000; i++) v.push_back((i * 7919) % 100003);
    std::sort(v.begin(), v.end());
    std::cout << v[v.size() / 2] << std::endl;
}
"""
CRUN_RUN = """
umount /sys/fs/cgroup/unified 2>/dev/null || true
exec crun --root "$STATE" run --bundle "$B" "$ID" </dev/null
"""


async def _out(*argv: str, env: dict[str, str] | None = None) -> str:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"{argv[0]}: exit {proc.returncode}: {err.decode()[-500:]}")
    return out.decode()


class Bwrap:
    name = "fresh bwrap per call"

    def __init__(self, root: Path) -> None:
        self.root = root

    async def call(self) -> str:
        return await _out(
            "bwrap", "--ro-bind", str(self.root), "/", "--proc", "/proc", "--dev", "/dev",
            "--tmpfs", "/tmp", "--chdir", "/tmp",
            "--unshare-all", "--die-with-parent", "--new-session",
            "--uid", "1000", "--gid", "1000",
            "python3", "-c", "print(1)",
        )  # fmt: skip


class CrunRun:
    name = "fresh crun run per call"

    def __init__(self, root: Path) -> None:
        self.root = root
        self.state = fresh_dir(PEER / "state")
        self.bundles = fresh_dir(PEER / "bundles")
        self.n = 0

    async def call(self) -> str:
        self.n += 1
        cid = f"fn{self.n}"
        b = self.bundles / cid
        b.mkdir()
        cfg = bundle.config(
            bundle.BundleSpec(
                sandbox_id=cid,
                rootfs=self.root,
                platform_dir=Path("/nonexistent"),
                env=["PATH=/usr/bin:/bin", "HOME=/tmp"],
                cpu=1.0,
                memory=512 * 2**20,
                pids=256,
                cgroups_path=f"/corral/benchfn/{cid}",
                swap_accounting=True,
                readonly_root=True,
                tmpfs=(("/tmp", 512 * 2**20),),
            )
        )
        cfg["process"]["args"] = ["python3", "-c", "print(1)"]
        cfg["process"]["cwd"] = "/tmp"
        cfg["process"]["user"] = {"uid": 1000, "gid": 1000}
        cfg["mounts"] = [m for m in cfg["mounts"] if m["destination"] != "/.corral"]
        (b / "config.json").write_text(json.dumps(cfg))
        try:
            return await _out(
                "unshare", "-m", "--propagation", "private", "sh", "-c", CRUN_RUN,
                env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "STATE": str(self.state),
                     "B": str(b), "ID": cid},
            )  # fmt: skip
        finally:
            shutil.rmtree(b, ignore_errors=True)


async def load(call: Callable[[], Awaitable[str]], n: int, conc: int) -> tuple[list[float], float]:
    """n calls, at most conc at once: (latencies, wall seconds)."""
    gate = asyncio.Semaphore(conc)
    lat: list[float] = []

    async def one() -> None:
        async with gate:
            t0 = time.perf_counter()
            out = await call()
            lat.append(time.perf_counter() - t0)
            if out.strip() != "1":
                raise RuntimeError(f"unexpected output {out!r}")

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return lat, time.perf_counter() - t0


async def main(quick: bool) -> None:
    DATA.mkdir(parents=True, exist_ok=True)
    cfg = NodeConfig.from_env(data_dir=DATA, images=IMAGES, node="fnbench")
    cfg = replace(cfg, fncall_workers=WORKERS)
    store = ImageStore(IMAGES)
    mounts = LayerMounts(store, PEER / "m")
    root = mounts.ensure(store.resolve(IMAGE))
    n1 = 100 if quick else 300
    levels = {2: 100, 8: 200, 32: 300} if not quick else {2: 50, 8: 80, 32: 96}
    lat_rows: list[list[str]] = []
    tput_rows: list[list[str]] = []
    async with corral.AsyncClient(config=cfg) as client:
        await client.service.fncall.pool.warm(IMAGE, WORKERS)  # type: ignore[attr-defined]

        async def corral_call() -> str:
            r = await client.fncall.run("python", "print(1)")
            if r.status != "ok":
                raise RuntimeError(r)
            return r.stdout

        runners: list[tuple[str, Callable[[], Awaitable[str]]]] = [
            (f"Corral fncall (warm pool of {WORKERS})", corral_call),
            (Bwrap.name, Bwrap(root).call),
            (CrunRun.name, CrunRun(root).call),
        ]
        for _name, fn in runners:
            await load(fn, 10, 2)  # warm caches
        base: dict[int, float] = {}
        p50_corral = 0.0
        for name, fn in runners:
            lat, _ = await load(fn, n1, 1)
            p50 = median(lat) * 1000
            p50_corral = p50_corral or p50
            lat_rows.append(
                [name, f"{p50:.1f}", f"{pct(lat, 99) * 1000:.1f}", f"{p50 / p50_corral:.2f}"]
            )
            print(lat_rows[-1], flush=True)
            for conc, n in levels.items():
                _, wall = await load(fn, n, conc)
                rate = n / wall
                base.setdefault(conc, rate)
                tput_rows.append([name, str(conc), f"{rate:.0f}", f"{rate / base[conc]:.2f}"])
                print(tput_rows[-1], flush=True)

        compile_s, run_s, total_s = [], [], []
        for _ in range(5 if quick else 15):
            t0 = time.perf_counter()
            r = await client.fncall.run("cpp", CPP)
            total_s.append(time.perf_counter() - t0)
            assert r.status == "ok" and r.compile is not None and r.run is not None, r
            compile_s.append(r.compile.wall_time)
            run_s.append(r.run.wall_time)
    mounts.release_unused(list)
    # crun removed each call's cgroup; the peer's parent is ours to remove.
    for parent in Path("/sys/fs/cgroup").glob("*/corral/benchfn"):
        parent.rmdir()

    cpp_rows = [
        [
            "C++ (g++ -O2, <vector> + <algorithm>, sort 100k)",
            f"{median(compile_s) * 1000:.0f}",
            f"{median(run_s) * 1000:.1f}",
            f"{median(total_s) * 1000:.0f}",
            f"{pct(total_s, 99) * 1000:.0f}",
        ]
    ]
    sections = [
        "## `print(1)` in python, one call at a time\n\n"
        f"{n1} calls per runner. Target: Corral p50 <= 15 ms.\n\n"
        + table(["runner", "p50 (ms)", "p99 (ms)", "p50 / Corral's"], lat_rows),
        "## Throughput (calls/s) by concurrency\n\nSame job; ratio to Corral at the same "
        "concurrency. Target: Corral >= 150 calls/s on 2 cores.\n\n"
        + table(["runner", "concurrency", "calls/s", "ratio to Corral"], tput_rows),
        "## Compile and run apart\n\n"
        + table(
            ["program", "compile p50 (ms)", "run p50 (ms)", "call p50 (ms)", "call p99 (ms)"],
            cpp_rows,
        ),
    ]
    path = write_result("fncall", "Function calls: warm pool vs a fresh sandbox per call", sections)
    print(f"wrote {path}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    asyncio.run(main(ap.parse_args().quick))
