"""A Ray cluster of Corral's own on this machine (`cluster up --local-nodes N`).

Ours, and only ours, is stopped: `ray stop` stops every Ray of the machine,
including a user's own. Every `ray start` runs with a marker in its
environment (MARKER=<cluster dir>, inherited by everything Ray starts) and
the head with its `--temp-dir` under the cluster directory. What belongs to
this Ray is then: the processes whose environment carries the marker or
whose command line names the temp dir, and every descendant of those (a
process may clear its environment, not its parent). Nothing of this needs
the `up` that started it: it survives `up` being killed at any point.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral.errors import Unavailable

Say = Callable[[str], None]
MARKER = "CORRAL_RAY_OF"


def ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


def ray_env() -> dict[str, str]:
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}


def init(address: str) -> None:
    """Connect this process to the Ray at `address` as a driver."""
    import logging

    import ray

    from corral.cluster.actors import NAMESPACE

    ray.init(address=address, namespace=NAMESPACE, logging_level=logging.ERROR, log_to_driver=False)


def nodes(ray: Any) -> list[dict[str, Any]]:
    alive = [n for n in ray.nodes() if n["Alive"]]
    # The head first, then by id: stable for one Ray cluster.
    return sorted(
        alive, key=lambda n: ("node:__internal_head__" not in n["Resources"], n["NodeID"])
    )


def temp_dir(directory: Path) -> Path:
    # Ray puts unix sockets under it (limit 107 bytes with its own names).
    return directory / "ray"


def start(count: int, port: int, directory: Path, say: Say, timeout: float = 120.0) -> str:
    """`count` Ray nodes (a head and count-1 workers) on this machine."""
    address = f"127.0.0.1:{port}"
    common = ["--num-cpus=1", "--object-store-memory=80000000", "--disable-usage-stats"]
    head = [
        "--head", f"--port={port}", f"--temp-dir={temp_dir(directory)}",
        "--include-dashboard=false",
    ]  # fmt: skip
    say(f"starting a local Ray cluster of {count} nodes at {address}")
    env = {**ray_env(), MARKER: str(directory)}
    for argv in [head] + [[f"--address={address}"]] * (count - 1):
        proc = subprocess.Popen(
            [ray_bin(), "start", *argv, *common],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
            start_new_session=True,  # a Ctrl-C of `up` is handled by up, not by Ray
        )  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise Unavailable(f"`ray start` did not finish in {timeout:g} s") from None
        if proc.returncode != 0:
            tail = " | ".join(out.strip().splitlines()[-4:])[-600:]
            raise Unavailable(f"`ray start {' '.join(argv[:2])}` failed: {tail}")
    return address


def _procs(directory: Path) -> dict[int, tuple[int, bool]]:
    """pid -> (parent pid, marked as this cluster's) of every process."""
    env_mark = f"{MARKER}={directory}\0".encode()
    cmd_mark = str(temp_dir(directory)).encode()
    out: dict[int, tuple[int, bool]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue  # gone, or a kernel thread
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        out[int(entry.name)] = (parent, env_mark in env or cmd_mark in cmd)
    return out


def processes(directory: Path) -> list[int]:
    """The processes of this cluster's Ray (see the module's docstring)."""
    procs = _procs(directory)
    ours = {p for p, (_parent, marked) in procs.items() if marked}
    ours.discard(os.getpid())
    grew = True
    while grew:
        kids = {p for p, (parent, _m) in procs.items() if parent in ours and p not in ours}
        ours |= kids
        grew = bool(kids)
    ours.discard(os.getpid())
    return sorted(ours)


def stop(directory: Path, grace: float = 10.0) -> int:
    """Stop this cluster's Ray: SIGTERM, then SIGKILL what is left after
    `grace` seconds. Returns how many processes there were."""
    found = processes(directory)
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for pid in processes(directory):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while processes(directory) and time.monotonic() < deadline:
            time.sleep(0.1)
    left = processes(directory)
    if left:
        raise Unavailable(f"Ray processes {left} survived SIGKILL")
    return len(found)
