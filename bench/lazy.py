"""Layers loaded on demand, measured as DSec measured them.

    corral bench lazy [--quick]

1. Bytes fetched / layer size when a sandbox runs a real project's test
   suite from a cold cache (base image of several hundred MB).
2. Burst start of 64 sandboxes from an HTTP store capped at 100 MB/s, cold
   node: lazy loading vs eager (download every blob, then start), in the
   same run: time to all-ready and bytes written to the local disk.
3. Layer update cost: change a toolkit shared by 100 image combinations;
   rebuild one layer vs rebuild every combined image.
4. Read throughput through the lazy loader (FUSE), cold and warm, vs the
   same EROFS on a plain loop device and on the blob file itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corral
from _common import IMAGES, fresh_dir, table, write_result
from corral.config import NodeConfig
from corral.host import mounts
from corral.images import registry
from corral.images.build import build_debootstrap, build_from_dir
from corral.images.objects import HttpObjects, LocalObjects, open_store
from corral.images.store import ImageStore
from corral.rollout import demo_images as di

WORK = Path("/var/lib/corral-lazy")
BIG_BASE = "debian-python-full:bookworm"
BIG_PACKAGES = ["python3", "python3-pip", "python3-numpy", "python3-yaml", "git", "gcc", "make"]
MB = 1e6


def quiet(task: str, done: float, total: float | None) -> None:
    pass


def disk_written() -> int:
    """Bytes the host has written to its disks (sectors * 512)."""
    total = 0
    for dev in Path("/sys/block").iterdir():
        if dev.name.startswith(("vd", "sd", "nvme", "xvd")):
            total += int((dev / "stat").read_text().split()[6]) * 512
    return total


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def node(name: str, images: Path, **kw: object) -> NodeConfig:
    data = fresh_dir(WORK / name)
    return NodeConfig.from_env(
        data_dir=data, images=images, node=name, scratch_size=64 * 2**30, **kw
    )


def lazy_stats(cfg: NodeConfig) -> dict[str, dict[str, int]]:
    doc = json.loads((cfg.data_dir / "lazy" / "fs" / ".stats").read_bytes())
    return doc["layers"]  # type: ignore[no-any-return]


# ----------------------------------------------------------------- 1. fraction


async def fraction(shared: LocalObjects, src: ImageStore) -> str:
    rows = []
    for project in di.PROJECTS:
        images = fresh_dir(WORK / "img-frac")
        store = ImageStore(images)
        for ref in (BIG_BASE, di.TOOLKIT, project.ref):
            registry.pull(store, ref, shared, quiet)
        cfg = node("frac", images)
        async with corral.AsyncClient(config=cfg) as c:
            sbx = await c.sandboxes.create(
                image=BIG_BASE, workspace=project.ref, toolkit=di.TOOLKIT
            )
            r = await sbx.commands.run(project.test_command, timeout=600)
            stats = lazy_stats(cfg)
            await sbx.close()
        whole = [
            stats[src.resolve(ref).digest]
            for ref in (BIG_BASE, project.ref, di.TOOLKIT)
            if src.resolve(ref).digest in stats
        ]
        size, got = sum(s["blob_size"] for s in whole), sum(s["fetched_bytes"] for s in whole)
        rows.append(
            [
                project.name,
                "**whole image**",
                f"{size / MB:.1f}",
                f"{got / MB:.2f}",
                f"**{100 * got / size:.1f}%**",
                "pass" if r.exit_code == 0 else "fail",
            ]
        )
        for ref in (BIG_BASE, project.ref, di.TOOLKIT):
            s = stats.get(src.resolve(ref).digest)
            if s is None:
                continue
            rows.append(
                [
                    project.name,
                    ref,
                    f"{s['blob_size'] / MB:.1f}",
                    f"{s['fetched_bytes'] / MB:.2f}",
                    f"{100 * s['fetched_bytes'] / max(1, s['blob_size']):.1f}%",
                    "pass" if r.exit_code == 0 else f"exit {r.exit_code}",
                ]
            )
    return (
        "## 1. Bytes fetched when a sandbox runs a project's test suite (cold cache)\n\n"
        f"Base `{BIG_BASE}` is debootstrap bookworm with {', '.join(BIG_PACKAGES)}; "
        "readahead 4 chunks of 64 KiB.\n\n"
        + table(
            ["project", "layer", "layer data (MB)", "fetched (MB)", "fetched / size", "suite"], rows
        )
        + "\n\nTarget: <= 10% of each image's bytes (DSec: 4-13%). The small "
        "workspace and toolkit layers are read almost whole (a test suite imports all "
        "of its project and of pytest); the base, which is most of the bytes, is not."
    )


# ----------------------------------------------------------------- 2. burst


def start_blobd(root: Path, port: int, rate: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "corral.cli.main",
            "blobd",
            "--root",
            str(root),
            "--port",
            str(port),
            "--rate",
            rate,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    remote = HttpObjects(f"http://127.0.0.1:{port}")
    for _ in range(200):
        try:
            remote.list("tags")
            return proc
        except Exception:
            time.sleep(0.05)
    raise RuntimeError("blobd did not start")


async def burst(src: ImageStore, n: int, rate: str) -> str:
    served = fresh_dir(WORK / "served")
    shared = LocalObjects(served)
    registry.push(src, BIG_BASE, shared, quiet)
    port = 7391
    proc = start_blobd(served, port, rate)
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        for mode in ("lazy", "eager"):
            images = fresh_dir(WORK / f"img-{mode}")
            cfg = node(f"burst{mode}", images, lazy=(mode == "lazy"))
            drop_caches()
            w0, t0 = disk_written(), time.perf_counter()
            registry.pull(
                ImageStore(images), BIG_BASE, open_store(url), quiet, eager=(mode == "eager")
            )
            pulled = time.perf_counter() - t0
            async with corral.AsyncClient(config=cfg) as c:

                async def one(t0: float = t0) -> float:
                    sbx = await c.sandboxes.create(image=BIG_BASE, memory="256MiB")
                    r = await sbx.commands.run("python3 -c 'import json, yaml; print(1)'")
                    assert r.stdout == "1\n", r.stderr
                    return time.perf_counter() - t0

                ready = await asyncio.gather(*(one() for _ in range(n)))
                all_ready = max(ready)
                os.sync()
                written = disk_written() - w0
                fetched = (
                    sum(s["fetched_bytes"] for s in lazy_stats(cfg).values())
                    if mode == "lazy"
                    else src.resolve(BIG_BASE).blob_size
                )
                for s in await c.sandboxes.list():
                    await s.close()
            rows.append(
                [
                    mode,
                    f"{pulled:.2f}",
                    f"{all_ready:.2f}",
                    f"{fetched / MB:.1f}",
                    f"{written / MB:.1f}",
                ]
            )
    finally:
        proc.kill()
    lazy, eager = rows
    speed = float(eager[2]) / float(lazy[2])
    writes = float(lazy[4]) / max(0.1, float(eager[4]))
    return (
        "## 2. Burst start from a remote store\n\n"
        f"{n} sandboxes at once, each running `python3 -c 'import json, yaml'`, on a "
        f"cold node; the store is `corral blobd` on loopback capped at {rate}/s. Eager "
        "downloads the layer's blobs whole, then starts; lazy starts at once and "
        "fetches chunks on first read. Disk writes are the host's block-device "
        "counters over the whole run.\n\n"
        + table(
            [
                "mode",
                "pull (s)",
                "all ready (s)",
                "fetched from store (MB)",
                "written to local disk (MB)",
            ],
            rows,
        )
        + f"\n\nLazy is {speed:.1f}x faster to all-ready and writes {writes:.2f}x the "
        "bytes of eager. Target: >= 2x faster, <= 1/3 of the disk writes."
    )


# ----------------------------------------------------------------- 3. update


def update_cost(src: ImageStore, combos: int, sample: int) -> str:
    base, tk = src.resolve(BIG_BASE), src.resolve(di.TOOLKIT)
    # The toolkit's tree, from its own layer (mounted read-only).
    mnt = WORK / "mnt"
    trees = {}
    for name, layer in (("base", base), ("toolkit", tk)):
        m = fresh_dir(mnt / name)
        mounts.mount(
            str(src.blob_path(layer.meta_digest)),
            str(m),
            "erofs",
            mounts.MS_RDONLY,
            f"device={src.blob_path(layer.blob_digest)}",
        )
        trees[name] = m
    stage = WORK / "stage"
    try:
        fresh_dir(stage)
        shutil.copytree(trees["toolkit"], stage / "tk", symlinks=True)
        (stage / "tk" / "usr/local/bin/toolkit-version").write_text("v2\n")
        t0 = time.perf_counter()
        new_tk = build_from_dir(src, stage / "tk", tag="pytest-bench:v2", kind="toolkit")
        one_layer = time.perf_counter() - t0
        layer_bytes = new_tk.meta_size + new_tk.blob_size
        # Combined images: base + workspace + toolkit squashed, one per combination.
        times, sizes = [], []
        for i in range(sample):
            combo = fresh_dir(stage / f"combo{i}")
            subprocess.run(["cp", "-a", f"{trees['base']}/.", str(combo)], check=True)
            subprocess.run(["cp", "-a", f"{stage / 'tk'}/.", str(combo)], check=True)
            (combo / "workspace").mkdir(exist_ok=True)
            (combo / "workspace" / f"task{i}.txt").write_text(str(i))
            t0 = time.perf_counter()
            layer = build_from_dir(src, combo, tag=None, kind="base")
            times.append(time.perf_counter() - t0)
            sizes.append(layer.meta_size + layer.blob_size)
            shutil.rmtree(combo)
    finally:
        for m in trees.values():
            mounts.umount(str(m))
        shutil.rmtree(stage, ignore_errors=True)
        src.untag("pytest-bench:v2")
        src.gc(set())
    per_time, per_bytes = sum(times) / sample, sum(sizes) / sample
    rows = [
        ["one toolkit layer (Corral)", "1", f"{layer_bytes / MB:.1f}", f"{one_layer:.2f}"],
        [
            f"combined images (measured {sample}, x{combos})",
            str(combos),
            f"{per_bytes * combos / MB:.0f}",
            f"{per_time * combos:.0f}",
        ],
    ]
    return (
        "## 3. Cost of updating a toolkit shared by 100 images\n\n"
        "Corral rebuilds one layer; with combined images every base + workspace + "
        "toolkit combination is rebuilt (squashed EROFS of the merged tree; measured on "
        f"{sample} combinations and multiplied by {combos}).\n\n"
        + table(["what is rebuilt", "images", "bytes written (MB)", "build time (s)"], rows)
        + f"\n\nRatio: {per_bytes * combos / layer_bytes:.0f}x the bytes, "
        f"{per_time * combos / one_layer:.0f}x the time (O(m) vs O(m x N))."
    )


# ----------------------------------------------------------------- 4. throughput


def throughput(src: ImageStore, size_mb: int) -> str:
    stage = fresh_dir(WORK / "tp")
    (stage / "data").mkdir()
    with open(stage / "data" / "big", "wb") as f:
        for _ in range(size_mb):
            f.write(os.urandom(1 << 20))
    layer = build_from_dir(src, stage / "data", tag="bench-big:1", kind="layer")
    shutil.rmtree(stage / "data")
    shared = LocalObjects(fresh_dir(WORK / "tp-served"))
    registry.push(src, "bench-big:1", shared, quiet)
    rows = []

    def read_all(path: Path) -> float:
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.read(1 << 20):
                pass
        return size_mb * (1 << 20) / MB / (time.perf_counter() - t0)

    meta, blob = src.blob_path(layer.meta_digest), src.blob_path(layer.blob_digest)
    m = fresh_dir(stage / "m")

    # Plain loop devices (metadata and data each on one).
    def losetup(path: Path) -> str:
        return subprocess.run(
            ["losetup", "-f", "--show", "-r", str(path)], capture_output=True, text=True, check=True
        ).stdout.strip()

    loops = [losetup(meta), losetup(blob)]
    try:
        mounts.mount(loops[0], str(m), "erofs", mounts.MS_RDONLY, f"device={loops[1]}")
        drop_caches()
        cold = read_all(m / "big")
        hot = read_all(m / "big")
        rows.append(["EROFS on loop devices", f"{cold:.0f}", "-", f"{hot:.0f}"])
        mounts.umount(str(m), detach=False)
    finally:
        for loop in loops:
            subprocess.run(["losetup", "-d", loop], check=False)
    # The blob file itself (file-backed EROFS, what the loader serves from).
    mounts.mount(str(meta), str(m), "erofs", mounts.MS_RDONLY, f"device={blob}")
    drop_caches()
    cold = read_all(m / "big")
    hot = read_all(m / "big")
    mounts.umount(str(m))
    rows.append(["EROFS on the blob file", f"{cold:.0f}", "-", f"{hot:.0f}"])
    # Through the lazy loader, from a store (cold: nothing cached).
    images = fresh_dir(WORK / "img-tp")
    registry.pull(ImageStore(images), "bench-big:1", shared, quiet)

    async def via_loader() -> tuple[float, float, float]:
        cfg = node("tp", images, lazy_readahead=16)
        async with corral.AsyncClient(config=cfg) as c:
            sbx = await c.sandboxes.create(image=di.BASE, toolkit="bench-big:1")
            path = cfg.mounts_dir / layer.digest.removeprefix("sha256:")[:16] / "big"
            drop_caches()
            cold = read_all(path)
            drop_caches()
            warm = read_all(path)
            hot = read_all(path)
            await sbx.close()
        return cold, warm, hot

    # The sandbox also needs the base image in this node's store.
    registry.push(src, di.BASE, shared, quiet)
    registry.pull(ImageStore(images), di.BASE, shared, quiet)
    cold, warm, hot = asyncio.run(via_loader())
    rows.append(
        [
            "EROFS through the lazy loader (FUSE, 64 KiB chunks, readahead 16)",
            f"{cold:.0f}",
            f"{warm:.0f}",
            f"{hot:.0f}",
        ]
    )
    src.untag("bench-big:1")
    src.gc(set())
    shutil.rmtree(stage, ignore_errors=True)
    return (
        "## 4. Sequential read throughput (MB/s)\n\n"
        f"One {size_mb} MiB file. Cold: page cache dropped and, for the loader, nothing "
        "in its chunk cache (chunks come from a local-directory store and are verified). "
        "Warm: chunks in the loader's cache, page cache dropped. Hot: in the page "
        "cache.\n\n" + table(["path", "cold", "warm (chunk cache)", "hot"], rows)
    )


async def prepare(quick: bool) -> tuple[ImageStore, LocalObjects]:
    src = ImageStore(IMAGES)
    build_debootstrap(src, "bookworm", BIG_PACKAGES, tag=BIG_BASE, progress=quiet)
    di.ensure_all(src, Path("/var/lib/corral/cache/sdists"), quiet)
    shared = LocalObjects(fresh_dir(WORK / "shared"))
    for ref in (BIG_BASE, di.TOOLKIT, *(p.ref for p in di.PROJECTS)):
        registry.push(src, ref, shared, quiet)
    return src, shared


def main(quick: bool) -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    src, shared = asyncio.run(prepare(quick))
    sections = [asyncio.run(fraction(shared, src))]
    print(sections[-1], flush=True)
    sections.append(asyncio.run(burst(src, 16 if quick else 64, "100MB")))
    print(sections[-1], flush=True)
    sections.append(update_cost(src, 100, 2 if quick else 5))
    print(sections[-1], flush=True)
    sections.append(throughput(src, 64 if quick else 256))
    print(sections[-1], flush=True)
    path = write_result("lazy", "Image layers loaded on demand", sections)
    shutil.rmtree(WORK, ignore_errors=True)
    print(path)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    main(ap.parse_args().quick)
