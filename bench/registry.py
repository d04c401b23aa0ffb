"""Bring-your-own-environment costs: a Dockerfile built by Corral next to
buildah, and an image of several hundred MB started from a registry
(eager pull) next to the same image started lazily from a blob store.

    corral bench registry

1. Build: a Dockerfile FROM an image on a loopback registry (Debian's
   docker-registry), installing build-essential from Debian's mirror,
   copying a file and running it. Corral (each step a sandbox and a
   committed layer) and buildah 1.28 (Debian's; vfs storage, chroot
   isolation: what runs on this host) build it cold, again with nothing
   changed, and after a change to the file (the COPY and what follows
   rerun). Same Dockerfile, same context, same registry, same run.
2. Start: the built image pushed to the registry. Eager: a cold node pulls
   it whole (skopeo fetches every blob; each layer becomes a Corral layer),
   then starts a sandbox and runs a first command. Lazy: the same stack in a
   blob store (`corral blobd` on loopback), a cold node registers its
   manifests, starts a sandbox, and the first command reads only what it
   touches. Bytes fetched and time to the first command's answer.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx

import corral
from _common import IMAGES, fresh_dir, serve, table, wait_up, write_result
from corral.build.builder import Builder, Options
from corral.config import NodeConfig
from corral.images import registry as blobs
from corral.images.objects import HttpObjects
from corral.images.pull import pull
from corral.images.push import push
from corral.images.store import ImageStore
from lazy import start_blobd

WORK = Path("/var/lib/corral-registry-bench")
MB = 1e6
DOCKERFILE = """\
FROM {base}
RUN apt-get update -q && apt-get install -y -q --no-install-recommends build-essential \\
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY app.py .
RUN python3 app.py > out.txt && gcc --version | head -1 >> out.txt
"""
FIRST = "python3 -c 'print(1)'"


def quiet(task: str, done: float, total: float | None) -> None:
    pass


def start_registry(root: Path, port: int) -> subprocess.Popen[bytes]:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yml").write_text(
        f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {root / 'data'}\nhttp:\n  addr: 127.0.0.1:{port}\n  secret: bench\n"
    )
    proc = subprocess.Popen(["docker-registry", "serve", str(root / "config.yml")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    for _ in range(100):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v2/").status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.05)
    raise RuntimeError("docker-registry did not start")


def node(name: str, images: Path, **kw: object) -> NodeConfig:
    return NodeConfig.from_env(data_dir=fresh_dir(WORK / name), images=images, node=name, **kw)


def cleanup() -> None:
    """Stop what the bench's nodes left running (their lazy loaders and
    seccomp daemons live on after a client closes) and unmount their trees."""
    import signal

    from corral.host import mounts

    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and proc.name != str(os.getpid()):
            try:
                if str(WORK).encode() in (proc / "cmdline").read_bytes():
                    os.kill(int(proc.name), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
    time.sleep(0.5)
    for point, _fs, _src in sorted(mounts.mounts_under(WORK), key=lambda m: -len(m[0])):
        mounts.umount(point)


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


# ------------------------------------------------------------------ 1. build


RUN_ID = os.urandom(6).hex()  # this run's own file contents: no earlier run's cache


async def corral_builds(ctx: Path, base: str) -> dict[str, float]:
    out = {}
    (ctx / "Dockerfile").write_text(DOCKERFILE.format(base=base))
    (ctx / "app.py").write_text(f'print("v1 {RUN_ID}")\n')
    async with corral.AsyncClient() as c:
        for name, no_cache in (("cold", True), ("cached", False), ("changed", False)):
            if name == "changed":
                (ctx / "app.py").write_text(f'print("v2 {RUN_ID}")\n')
            t0 = time.perf_counter()
            await Builder(c, ctx, Options("bench-built:1", no_cache=no_cache)).build(
                (ctx / "Dockerfile").read_text()
            )
            out[name] = time.perf_counter() - t0
    return out


def buildah_builds(ctx: Path, base: str) -> dict[str, float] | str:
    if shutil.which("buildah") is None:
        return "buildah is not installed (apt-get install buildah)"
    root = fresh_dir(WORK / "buildah")
    argv = ["buildah", "--root", str(root / "storage"), "--runroot", str(root / "run"),
            "--storage-driver", "vfs", "bud", "--isolation", "chroot", "--layers",
            "--tls-verify=false", "-t", "bench-built:1", "-f", str(ctx / "Dockerfile"),
            str(ctx)]  # fmt: skip
    (ctx / "Dockerfile").write_text(DOCKERFILE.format(base=base))
    out: dict[str, float] = {}
    for name in ("cold", "cached", "changed"):
        version = "v2" if name == "changed" else "v1"
        (ctx / "app.py").write_text(f'print("{version} {RUN_ID}")\n')
        t0 = time.perf_counter()
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            return f"buildah failed here: {done.stderr.strip().splitlines()[-1][:200]}"
        out[name] = time.perf_counter() - t0
    shutil.rmtree(root, ignore_errors=True)
    return out


# ------------------------------------------------------------------ 2. start


async def first_command(cfg: NodeConfig, image: str, lazy: bool) -> tuple[float, int]:
    """Seconds to the first command's answer, and what the loader fetched."""
    t0 = time.perf_counter()
    async with corral.AsyncClient(config=cfg) as c:
        sbx = await c.sandboxes.create(image=image, memory="256MiB")
        r = await sbx.commands.run(FIRST)
        assert r.stdout == "1\n", r
        took = time.perf_counter() - t0
        fetched = _lazy_fetched(cfg) if lazy else 0  # read while the loader runs
        await sbx.close()
    return took, fetched


async def starts(reg: str) -> list[list[str]]:
    ref = f"{reg}/bench/built:1"
    src = ImageStore(IMAGES)
    await asyncio.to_thread(push, src, "bench-built:1", ref, quiet)
    size = sum(x.blob_size + x.meta_size for x in src.chain(src.resolve("bench-built:1")))
    rows = []
    # Eager: skopeo fetches every blob, then the layers are made; then the start.
    images = fresh_dir(WORK / "img-eager")
    store = ImageStore(images)
    drop_caches()
    t0 = time.perf_counter()
    await asyncio.to_thread(pull, store, ref, quiet)
    pulled = time.perf_counter() - t0
    fetched = sum(p.stat().st_size for p in (images / "oci" / "blobs" / "sha256").iterdir())
    started, _ = await first_command(node("eager", images, lazy=False), ref, lazy=False)
    total = pulled + started
    rows.append(["eager: pull from the registry, then start", f"{size / MB:.0f}",
                 f"{fetched / MB:.0f}", f"{pulled:.1f} s", f"{total:.1f} s"])  # fmt: skip
    # Lazy: the stack in a blob store; manifests only, data as read.
    served = fresh_dir(WORK / "served")
    from corral.images.objects import LocalObjects

    await asyncio.to_thread(blobs.push, src, "bench-built:1", LocalObjects(served), quiet)
    port = 7392
    proc = start_blobd(served, port, "10GB")
    try:
        images = fresh_dir(WORK / "img-lazy")
        cfg = node("lazy", images)
        drop_caches()
        t0 = time.perf_counter()
        await asyncio.to_thread(blobs.pull, ImageStore(images), "bench-built:1",
                                HttpObjects(f"http://127.0.0.1:{port}"), quiet)  # fmt: skip
        registered = time.perf_counter() - t0
        started, stats = await first_command(cfg, "bench-built:1", lazy=True)
    finally:
        proc.terminate()
        proc.wait()
    total = registered + started
    rows.append(["lazy: manifests from a blob store, data as read", f"{size / MB:.0f}",
                 f"{stats / MB:.1f}", f"{registered:.2f} s", f"{total:.2f} s"])  # fmt: skip
    return rows


def _lazy_fetched(cfg: NodeConfig) -> int:
    import json

    doc = json.loads((cfg.data_dir / "lazy" / "fs" / ".stats").read_bytes())
    return sum(int(s["fetched_bytes"]) for s in doc["layers"].values())


async def trials(server_url: str) -> list[list[str]]:
    """The test tasks (tests/integration/tasks), 35 oracle trials at once,
    with `corral tasks run`'s runner and with harbor's own CLI."""
    from corral.tasks.runner import Runner, oracle
    from corral.tasks.task import discover

    tasks_dir = Path(__file__).resolve().parents[1] / "tests" / "integration" / "tasks"
    rows = []
    async with corral.AsyncClient(server_url) as c:
        found = discover(tasks_dir)
        await Runner(c).run_all(found, oracle)  # images built (and cached) first
        t0 = time.perf_counter()
        results = await Runner(c).run_all(found, oracle, attempts=7, concurrency=35)
        wall = time.perf_counter() - t0
    right = sum(r.reward == (0.0 if r.task == "wrong-solution" else 1.0) for r in results)
    rows.append(["corral tasks run", str(len(results)), f"{right}/{len(results)}", f"{wall:.1f} s"])
    harbor = Path(__file__).resolve().parents[1] / ".venv-harbor" / "bin" / "harbor"
    if harbor.exists():
        jobs = fresh_dir(WORK / "harbor-jobs")
        t0 = time.perf_counter()
        done = subprocess.run(
            [str(harbor), "run", "-p", str(tasks_dir), "-a", "oracle", "-e",
             "corral.integrations.harbor:CorralEnvironment", "-o", str(jobs), "--job-name",
             "b", "-n", "35", "-k", "7"],
            env={**os.environ, "CORRAL_URL": server_url, "HOME": str(jobs)},
            capture_output=True, text=True,
        )  # fmt: skip
        wall = time.perf_counter() - t0
        import json

        docs = [json.loads(p.read_text()) for p in (jobs / "b").glob("*/result.json")]
        ok = sum(
            float(((d.get("verifier_result") or {}).get("rewards") or {}).get("reward", -1))
            == (0.0 if d["task_name"] == "wrong-solution" else 1.0)
            for d in docs
        )
        status = f"{ok}/{len(docs)}" if done.returncode == 0 else "harbor failed"
        rows.append(["harbor run (its CLI, Corral's provider)", str(len(docs)), status,
                     f"{wall:.1f} s (harbor's own start included)"])  # fmt: skip
    return rows


async def main() -> None:
    WORK.mkdir(parents=True, exist_ok=True)
    cleanup()
    port = 5077
    reg_proc = start_registry(fresh_dir(WORK / "registry"), port)
    reg = f"127.0.0.1:{port}"
    try:
        src = ImageStore(IMAGES)
        t0 = time.perf_counter()
        await asyncio.to_thread(push, src, "debian-python:bookworm",
                                f"{reg}/corral/debian-python:bookworm", quiet)  # fmt: skip
        base_push = time.perf_counter() - t0
        base = f"{reg}/corral/debian-python:bookworm"
        ctx = fresh_dir(WORK / "ctx")
        ours = await corral_builds(ctx, base)
        theirs = await asyncio.to_thread(buildah_builds, ctx, base)
        rows = []
        for name in ("cold", "cached", "changed"):
            if isinstance(theirs, dict):
                b = theirs[name]
                rows.append([name, f"{ours[name]:.1f} s", f"{b:.1f} s", f"{ours[name] / b:.2f}x"])
            else:
                rows.append([name, f"{ours[name]:.1f} s", "-", "-"])
        build = table(["build", "Corral", "buildah (vfs)", "Corral / buildah"], rows)
        if isinstance(theirs, str):
            build += f"\n\nbuildah: {theirs}"
        start_rows = await starts(reg)
        proc, url = serve(fresh_dir(WORK / "serve"))
        try:
            await wait_up(url)
            trial_rows = await trials(url)
        finally:
            proc.terminate()
            proc.wait()
    finally:
        reg_proc.terminate()
        reg_proc.wait()
        cleanup()
    path = write_result(
        "registry",
        "Bring your own environment: Dockerfile builds and registry images",
        [
            "## 1. A Dockerfile, built cold, again, and after a change to one file\n\n"
            "FROM an image on a loopback registry; RUN apt-get install build-essential "
            "(Debian's mirror); COPY; RUN. `changed`: the copied file differs, so the COPY "
            "and the RUN after it run again. buildah 1.28 with vfs storage and chroot "
            f"isolation, `--layers`. The base was pushed to the registry first "
            f"(`corral image push`, {base_push:.1f} s).\n\n" + build,
            "## 2. Starting the built image: eager pull from the registry vs lazy start\n\n"
            f"First command: `{FIRST}` in a new sandbox on a cold node (caches dropped). "
            "Eager: skopeo fetches every blob, each layer becomes a Corral layer, then the "
            "start. Lazy: the same stack in `corral blobd` on loopback; the node registers "
            "the manifests and the loader fetches chunks as they are read.\n\n"
            + table(
                [
                    "path",
                    "image (MB)",
                    "fetched (MB)",
                    "pull / register",
                    "to the first command's answer",
                ],
                start_rows,
            ),
            "## 3. 35 task trials at once (harbor's format, the oracle agent)\n\n"
            "The five tasks of tests/integration/tasks, seven trials each, all at once on "
            "one `corral serve`; images already built (cached). Right: the four right "
            "solutions score 1.0 and the wrong one 0.0.\n\n"
            + table(["runner", "trials", "rewards right", "time to the last result"], trial_rows),
        ],
    )
    print(path.read_text())


if __name__ == "__main__":
    asyncio.run(main())
