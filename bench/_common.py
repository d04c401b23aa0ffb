"""Shared helpers of the benchmarks: percentiles, the machine, tables."""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from corral.errors import CorralError
from corral.host import mounts

T = TypeVar("T")

RESULTS = Path(__file__).resolve().parent / "results"
IMAGES = Path(os.environ.get("CORRAL_IMAGES", "/var/lib/corral/images"))
IMAGE = "debian-python:bookworm"


async def unless_full(make: Callable[[], Awaitable[T]], refused: list[str]) -> T | None:
    """One create for a density record: the node's refusal is the record's
    end, kept in `refused`, not raised; once one is kept, nothing more is
    tried (None)."""
    if refused:
        return None
    try:
        return await make()
    except CorralError as exc:
        refused.append(f"{type(exc).__name__}: {exc}")
        return None


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _version(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        return "absent"


def machine() -> str:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    return (
        f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB RAM, kernel {platform.release()}, "
        f"{_version(['crun', '--version'])}, {_version(['runc', '--version'])}, "
        f"Python {platform.python_version()}"
    )


def mem_used() -> int:
    """Host memory in use: MemTotal - MemAvailable, in bytes."""
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def host_busy() -> float:
    """CPU seconds the whole host has spent busy (not idle, not iowait)
    since boot: a create's cost includes the kernel's work and other
    processes', which no one process's rusage shows."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def meminfo(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def write_result(name: str, title: str, sections: list[str]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.md"
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    body = f"# {title}\n\nMachine: {machine()}.\nRun: {when}, `{rerun(name)}`.\n\n"
    path.write_text(body + "\n\n".join(sections).rstrip() + "\n")
    return path


def rerun(name: str) -> str:
    """The command that made this result: the script that runs (a result's
    file name may differ from it, and one script writes several, by its
    arguments), as `corral bench` takes it."""
    script = Path(sys.argv[0])
    if script.parent.resolve() != Path(__file__).resolve().parent:
        return f"corral bench {name}"  # not run as a bench script
    return shlex.join(["corral", "bench", script.stem, *sys.argv[1:]])


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def leak_counts(data_dir: Path) -> dict[str, int]:
    """Kernel and disk objects a sandbox could leak, host-wide."""
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    loops = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    procs = 0
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                # A zombie is PID 1's to reap (crun leaves a sandbox's init
                # to it), and this host's PID 1 reaps late: a killed
                # sandbox shows as one for seconds. Live ones are leaks.
                zombie = (d / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
                if (d / "comm").read_text().strip() in ("corral-init", "sleep-bench"):
                    procs += not zombie
            except OSError:
                pass
    cgroups = 0
    for h in Path("/sys/fs/cgroup").iterdir():
        base = h / "corral"
        if base.is_dir():
            cgroups += sum(1 for _ in base.rglob("*") if _.is_dir())
    return {
        "overlay mounts": sum(" - overlay " in m for m in mounts),
        "mounts under data dir": sum(str(data_dir) in m for m in mounts)
        - (1 if any(str(data_dir / "scratch") in m for m in mounts) else 0),
        "loop devices": len([ln for ln in loops.splitlines() if ln.strip()]),
        "netns": len([ln for ln in netns.splitlines() if ln.strip()]),
        "sandbox cgroups": cgroups,
        "sandbox processes": procs,
    }


def fresh_dir(path: Path) -> Path:
    """`path`, empty. What a crashed run left mounted below it is detached
    first: rmtree cannot remove a mount point, and the next run would stop
    on it (FileExistsError)."""
    for mount_point, _fs, _src in sorted(mounts.mounts_under(path), key=lambda m: -len(m[0])):
        mounts.umount(mount_point)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


async def timed(n: int, fn: Callable[[], Awaitable[object]]) -> list[float]:
    """Seconds each of n awaited calls of fn took, one after another."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t0)
    return out


def serve(data: Path) -> tuple[subprocess.Popen[bytes], str]:
    """A `corral serve` of this checkout on a free port, on data dir `data`
    and the shared image store; the caller terminates it."""
    import socket
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "CORRAL_IMAGES": str(IMAGES)}
    argv = [sys.executable, "-m", "corral.cli.main", "--data-dir", str(data), "serve",
            "--port", str(port), "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


async def wait_up(url: str) -> None:
    import asyncio

    import httpx

    for _ in range(300):
        try:
            async with httpx.AsyncClient() as h:
                if (await h.get(f"{url}/healthz")).status_code == 200:
                    return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError("corral serve did not start")
