"""Container sandboxes, side by side with bare crun and runc in one run.

    corral bench container [--quick]

Peers: the same OCI bundle (same limits and namespaces, process `sleep`)
started by a minimal script that mounts the overlay and runs
`<runtime> create` + `<runtime> start` in a private mount namespace (crun
needs the cgroup2 mount hidden on these hybrid hosts; runc gets the same
wrapper so both pay the same). Both use the same shared EROFS layer mount
as lower dir. Corral's "ready" is stricter: its exec server has answered.

Measures: create-to-ready p50/p99 at concurrency 1, 16, 64; exec round
trip of `true`; sustained creation throughput; teardown time; leftovers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corral
from _common import (
    IMAGE,
    IMAGES,
    fresh_dir,
    leak_counts,
    median,
    pct,
    table,
    write_result,
)
from corral.config import NodeConfig
from corral.host import mounts as host_mounts
from corral.images.mounter import LayerMounts
from corral.images.store import ImageStore
from corral.runtimes.container import bundle

DATA = Path("/var/lib/corral-bench")
BASE = Path("/var/lib/corral-bench-peer")

PEER_SCRIPT = """
set -e
umount /sys/fs/cgroup/unified 2>/dev/null || true
mount -t overlay overlay -o "lowerdir=$LOWER,upperdir=$B/upper,workdir=$B/work" "$B/rootfs"
# The container inherits create's stdio: keep our pipes out of it.
"$RT" --root "$STATE" create --bundle "$B" "$ID" </dev/null >/dev/null 2>"$B/err" \
  || { cat "$B/err" >&2; exit 1; }
"$RT" --root "$STATE" start "$ID"
"""


def remove_peer_base() -> None:
    """The peers' bundles and state, with the tmpfs their state is on."""
    if BASE.exists():
        for point, _fs, _src in reversed(host_mounts.mounts_under(BASE)):
            host_mounts.umount(point)
    shutil.rmtree(BASE, ignore_errors=True)


def remove_peer_cgroups() -> None:
    """The peers' parent cgroups (and Corral's, when empty), in every
    hierarchy: crun leaves the parents of the groups it made. On a hybrid
    host also what the peers left beneath the cgroup2 mount: bare crun,
    with the mount hidden, makes a directory and a cgroup.procs file per
    container on the host's tmpfs there and never removes them
    (docs/container-runtime.md)."""
    for parent in ("corral/benchcrun", "corral/benchrunc", "corral"):
        for h in Path("/sys/fs/cgroup").iterdir():
            try:
                (h / parent).rmdir()
            except OSError:
                pass
    beneath = "/sys/fs/cgroup/unified/corral"
    subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c",
         "umount /sys/fs/cgroup/unified 2>/dev/null || exit 0; "
         f"rm -rf {beneath}/benchcrun {beneath}/benchrunc; rmdir {beneath} 2>/dev/null; true"],
        check=True,
    )  # fmt: skip


class Peer:
    """A bare OCI runtime driven by the minimal script above."""

    def __init__(self, runtime: str, lower: Path) -> None:
        self.rt = shutil.which(runtime) or runtime
        self.name = runtime
        self.lower = lower
        # Its state on a tmpfs, as crun's and runc's default /run/<rt> is on
        # a Linux host (Corral's is too: host/runfs.py); its bundles on disk.
        self.state = fresh_dir(BASE / f"{runtime}-state")
        host_mounts.mount("tmpfs", str(self.state), "tmpfs", 0, "mode=0700")
        self.root = fresh_dir(BASE / runtime)
        self.n = 0

    def _bundle(self, cid: str) -> Path:
        b = self.root / cid
        for d in ("rootfs", "upper", "work"):
            (b / d).mkdir(parents=True)
        cfg = bundle.config(
            bundle.BundleSpec(
                sandbox_id=cid,
                rootfs=b / "rootfs",
                platform_dir=Path("/nonexistent"),
                env=[],
                cpu=1.0,
                memory=256 * 2**20,
                pids=512,
                cgroups_path=f"/corral/bench{self.name}/{cid}",
                swap_accounting=True,
            )
        )
        cfg["process"]["args"] = ["/bin/sleep", "infinity"]
        cfg["mounts"] = [m for m in cfg["mounts"] if m["destination"] != "/.corral"]
        (b / "config.json").write_text(json.dumps(cfg))
        return b

    async def _sh(self, script: str, env: dict[str, str]) -> None:
        proc = await asyncio.create_subprocess_exec(
            "unshare",
            "-m",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", **env},
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"{self.name}: {err.decode()}")

    async def create(self) -> str:
        self.n += 1
        cid = f"{self.name}{self.n}"
        b = self._bundle(cid)
        await self._sh(
            PEER_SCRIPT,
            {
                "LOWER": str(self.lower),
                "B": str(b),
                "RT": self.rt,
                "STATE": str(self.state),
                "ID": cid,
            },
        )
        return cid

    async def exec_true(self, cid: str) -> None:
        await self._sh(
            "umount /sys/fs/cgroup/unified 2>/dev/null || true\n"
            '"$RT" --root "$STATE" exec "$ID" /bin/true',
            {"RT": self.rt, "STATE": str(self.state), "ID": cid},
        )

    async def delete(self, cid: str) -> None:
        await self._sh(
            "umount /sys/fs/cgroup/unified 2>/dev/null || true\n"
            '"$RT" --root "$STATE" delete --force "$ID"',
            {"RT": self.rt, "STATE": str(self.state), "ID": cid},
        )
        shutil.rmtree(self.root / cid, ignore_errors=True)


T = TypeVar("T")


async def timed(coro: Awaitable[T]) -> tuple[float, T]:
    t0 = time.perf_counter()
    result = await coro
    return time.perf_counter() - t0, result


async def burst(
    create: Callable[[], Awaitable[T]], delete: Callable[[T], Awaitable[object]], n: int
) -> list[float]:
    """n creates at once; per-create latency; then delete them all."""
    out = await asyncio.gather(*(timed(create()) for _ in range(n)))
    await asyncio.gather(*(delete(h) for _, h in out))
    return [t for t, _ in out]


async def main(quick: bool) -> None:
    DATA.mkdir(parents=True, exist_ok=True)  # the agent recovers whatever a killed run left
    cfg = NodeConfig.from_env(data_dir=DATA, images=IMAGES, node="bench", scratch_size=64 * 2**30)
    store = ImageStore(IMAGES)
    base_layer = store.resolve(IMAGE)
    peers_mounts = LayerMounts(store, BASE / "m")
    lower = peers_mounts.ensure(base_layer)
    before = leak_counts(DATA)
    levels = [1, 16] if quick else [1, 16, 64]
    reps = {1: 20 if quick else 50, 16: 2 if quick else 4, 64: 1 if quick else 2}
    rows_create: list[list[str]] = []
    ratios: dict[int, float] = {}

    async with corral.AsyncClient(config=cfg) as client:

        async def c_create() -> corral.AsyncSandbox:
            return await client.sandboxes.create(image=IMAGE, memory="256MiB")

        async def c_delete(s: corral.AsyncSandbox) -> None:
            await s.close()

        await burst(c_create, c_delete, 4)  # warm the layer mount and caches
        peers = {"crun": Peer("crun", lower), "runc": Peer("runc", lower)}
        for level in levels:
            results: dict[str, list[float]] = {"corral": [], "crun": [], "runc": []}
            for _ in range(reps[level]):
                results["corral"] += await burst(c_create, c_delete, level)
                for name, peer in peers.items():
                    results[name] += await burst(peer.create, peer.delete, level)
            ratios[level] = median(results["corral"]) / median(results["crun"])
            for name, vals in results.items():
                rows_create.append(
                    [
                        str(level),
                        name,
                        f"{median(vals) * 1000:.1f}",
                        f"{pct(vals, 99) * 1000:.1f}",
                        f"{median(vals) / median(results['crun']):.2f}x",
                    ]
                )

        # Exec round trip.
        sbx = await c_create()
        for _ in range(20):
            await sbx.commands.run(["true"])
        direct = [
            (await timed(sbx.commands.run(["true"])))[0] for _ in range(500 if not quick else 100)
        ]
        shell = [
            (await timed(sbx.commands.run("true")))[0] for _ in range(500 if not quick else 100)
        ]
        cid = await peers["crun"].create()
        crun_exec = [
            (await timed(peers["crun"].exec_true(cid)))[0] for _ in range(100 if not quick else 30)
        ]
        await peers["crun"].delete(cid)
        await sbx.close()
        rows_exec = [
            [
                'corral `commands.run(["true"])`',
                f"{median(direct) * 1000:.2f}",
                f"{pct(direct, 99) * 1000:.2f}",
            ],
            [
                'corral `commands.run("true")` (platform sh)',
                f"{median(shell) * 1000:.2f}",
                f"{pct(shell, 99) * 1000:.2f}",
            ],
            [
                "bare `crun exec ID /bin/true`",
                f"{median(crun_exec) * 1000:.2f}",
                f"{pct(crun_exec, 99) * 1000:.2f}",
            ],
        ]

        # Sustained creation, then teardown.
        total = 120 if quick else 400
        sem = asyncio.Semaphore(16)
        boxes: list[corral.AsyncSandbox] = []

        async def one() -> None:
            async with sem:
                boxes.append(await c_create())

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(total)))
        create_rate = total / (time.perf_counter() - t0)
        close_lat: list[float] = []

        async def close(s: corral.AsyncSandbox) -> None:
            async with sem:
                close_lat.append((await timed(s.close()))[0])

        t0 = time.perf_counter()
        await asyncio.gather(*(close(s) for s in boxes))
        close_wall = time.perf_counter() - t0

        peer_rate = {}
        for name, peer in peers.items():
            ids: list[str] = []

            async def pone(peer: Peer = peer, ids: list[str] = ids) -> None:
                async with sem:
                    ids.append(await peer.create())

            t0 = time.perf_counter()
            await asyncio.gather(*(pone() for _ in range(total // 2)))
            peer_rate[name] = (total // 2) / (time.perf_counter() - t0)
            await asyncio.gather(*(peer.delete(i) for i in ids))

    peers_mounts.release_unused(list)
    remove_peer_base()
    remove_peer_cgroups()
    await asyncio.sleep(2)  # the host's init reaps exited container inits
    after = leak_counts(DATA)

    sections = [
        "## Create to ready (ms)\n\nCorral: `sandboxes.create()` returns once the sandbox's "
        "exec server answers, with every defence on (seccomp allow-list with notify, user "
        "namespace). Peers: the script returns after `<runtime> start`; their bundle has "
        "neither.\n\n"
        + table(["concurrency", "system", "p50", "p99", "p50 vs bare crun"], rows_create)
        + "\n\nTarget p50 within 1.25x of bare crun: "
        + ", ".join(f"concurrency {k}: {v:.2f}x" for k, v in ratios.items())
        + ".",
        "## Exec round trip of `true` (ms)\n\n"
        + table(["path", "p50", "p99"], rows_exec)
        + "\n\nTarget p50 <= 3 ms.",
        "## Sustained creation (2 cores, 16 in flight)\n\n"
        + table(
            ["system", "sandboxes/s"],
            [["corral", f"{create_rate:.1f}"]] + [[k, f"{v:.1f}"] for k, v in peer_rate.items()],
        )
        + f"\n\nTarget >= 40/s. Corral created {total} sandboxes; each peer {total // 2}.",
        "## Teardown\n\n"
        + table(
            [
                "sandboxes",
                "wall (s)",
                "per sandbox (ms, wall/n)",
                "close p50 (ms)",
                "close p99 (ms)",
            ],
            [
                [
                    str(total),
                    f"{close_wall:.2f}",
                    f"{close_wall / total * 1000:.1f}",
                    f"{median(close_lat) * 1000:.1f}",
                    f"{pct(close_lat, 99) * 1000:.1f}",
                ]
            ],
        ),
        "## Leftovers (host-wide, before the run vs after)\n\n"
        + table(
            ["object", "before", "after"],
            [[k, str(before[k]), str(after[k])] for k in before],
        ),
    ]
    path = write_result("container", "Container sandboxes vs bare crun and runc", sections)
    print(path.read_text())


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    asyncio.run(main(args.quick))
