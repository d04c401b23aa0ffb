"""A simulated cell on this machine: a PostgreSQL of its own, simulated
node agents (bench/sim/node.py, one process for all of them) and unmodified
`corral serve --gateway` replicas, with the CPU each part spends read from
/proc. What bench/cellsim.py measures with; tests/framework's GatewayProcess
starts the gateways exactly as the cluster tests do.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tests.framework.cluster import make_project
from tests.framework.processes import GatewayProcess, free_port, run_sync

from corral.control.postgres import LocalPostgres
from corral.control.schema import migrate
from corral.db import connect

NODE_SCRIPT = Path(__file__).resolve().parent / "node.py"
NODE_KEY = "nk-sim-" + "0" * 8


def psql_bin() -> str:
    return sorted(glob.glob("/usr/lib/postgresql/*/bin/psql"))[-1]


def clock_ticks(pid: int, *, children: bool = False) -> int:
    """utime + stime (and, with `children`, what its reaped children spent)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    ticks = int(fields[11]) + int(fields[12])
    return ticks + (int(fields[13]) + int(fields[14]) if children else 0)


def children_of(parent: int) -> list[int]:
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            ppid = int(Path(stat).read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent:
            out.append(int(stat.split("/")[2]))
    return out


def busy_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of the whole machine, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values[:8]) - idle, sum(values[:8])


@dataclass
class CpuSnapshot:
    at: float
    parts: dict[str, float]
    busy: float


@dataclass
class SimCell:
    root: Path
    nodes: int = 160
    per_node: int = 3200
    gateways: int = 1
    create_delay: float = 0.01
    node_timeout: float = 10.0
    full: tuple[str, ...] = ()
    statements: bool = False  # load pg_stat_statements (which queries dominate)
    state: str = ""
    sim_port: int = 0
    sims: list[subprocess.Popen[bytes]] = field(default_factory=list)
    replicas: list[GatewayProcess] = field(default_factory=list)
    _logs: list[IO[bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.pg = LocalPostgres(self.root / "pg", port=free_port())

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)  # PostgreSQL runs as its own user
        self.state = self.pg.start()
        if self.statements:
            with (self.pg.data / "postgresql.conf").open("a") as conf:
                conf.write("shared_preload_libraries = 'pg_stat_statements'\n")
            self.pg.stop()
            self.pg.start()
            self.psql("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        run_sync(self._migrate())
        self.sim_port = free_port()
        log = open(self.root / "simnode.log", "ab")  # noqa: SIM115 (held while it runs)
        self._logs.append(log)
        argv = [
            sys.executable, str(NODE_SCRIPT), "--state", self.state, "--nodes", str(self.nodes),
            "--per-node", str(self.per_node), "--port", str(self.sim_port),
            "--create-delay", str(self.create_delay), "--full", ",".join(self.full),
        ]  # fmt: skip
        env = dict(os.environ, CORRAL_NODE_KEY=NODE_KEY)
        self.sims.append(subprocess.Popen(argv, env=env, stdout=log, stderr=log))
        self.wait_alive()
        for i in range(self.gateways):
            gw = GatewayProcess(
                self.state, NODE_KEY, self.node_timeout, self.root / f"gateway{i}.log"
            )
            self.replicas.append(gw)
            gw.start()

    async def _migrate(self) -> None:
        db = await connect(self.state)
        try:
            await migrate(db)
        finally:
            await db.aclose()

    def wait_alive(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            alive = self.psql("SELECT COUNT(*) FROM nodes WHERE state = 'alive'")
            if alive and int(alive[0][0]) >= self.nodes:
                return
            if any(p.poll() is not None for p in self.sims) or time.monotonic() > deadline:
                raise RuntimeError(f"simulated nodes did not join; see {self.root}/simnode.log")
            time.sleep(0.1)

    def stop(self) -> None:
        for gw in self.replicas:
            gw.kill(signal.SIGTERM)
        for p in self.sims:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for log in self._logs:
            log.close()
        self.pg.stop()

    def server_log(self, needle: str) -> int:
        """How many lines of PostgreSQL's log contain `needle`."""
        try:
            text = (self.pg.data / "server.log").read_text(errors="replace")
        except OSError:
            return 0
        return sum(needle in line for line in text.splitlines())

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # ---------------------------------------------------------------- the store

    def psql(self, sql: str) -> list[list[str]]:
        """`sql` as PostgreSQL's superuser on the corral database: rows of fields."""
        out = subprocess.run(
            ["runuser", "-u", "postgres", "--", psql_bin(), "-h", str(self.pg.data),
             "-p", str(self.pg.port), "-d", "corral", "-At", "-F", "\t",
             "-v", "ON_ERROR_STOP=1", "-c", sql],
            check=True, capture_output=True, text=True, cwd="/",
        ).stdout  # fmt: skip
        return [line.split("\t") for line in out.splitlines() if line]

    def project(self, name: str, parent: str | None = None, **limits: int) -> str:
        """Create a project; returns an API key of it."""
        return make_project(self.state, name, parent, **limits)

    # ---------------------------------------------------------------- CPU

    def pids(self) -> dict[str, list[int]]:
        return {
            "gateways": [g.proc.pid for g in self.replicas if g.proc is not None],
            "simnodes": [p.pid for p in self.sims],
        }

    def postmaster(self) -> int:
        return int((self.pg.data / "postmaster.pid").read_text().split()[0])

    def cpu(self) -> CpuSnapshot:
        """CPU seconds so far: PostgreSQL (the postmaster, its live backends
        and the ones it reaped), each group of our processes, this process
        (the load generator) and the whole machine."""
        hz = os.sysconf("SC_CLK_TCK")
        master = self.postmaster()
        pg = clock_ticks(master, children=True) + sum(map(clock_ticks, children_of(master)))
        parts = {"postgres": pg / hz}
        for name, pids in self.pids().items():
            parts[name] = sum(map(clock_ticks, pids)) / hz
        for i, pid in enumerate(self.pids()["gateways"]):
            parts[f"gateway{i}"] = clock_ticks(pid) / hz
        t = os.times()
        parts["loadgen"] = t.user + t.system
        return CpuSnapshot(time.perf_counter(), parts, busy_ticks()[0] / hz)


def cpu_delta(before: CpuSnapshot, after: CpuSnapshot) -> tuple[float, dict[str, float], float]:
    """(wall seconds, CPU seconds by part, CPU seconds of the whole machine)."""
    parts = {k: after.parts[k] - before.parts.get(k, 0.0) for k in after.parts}
    return after.at - before.at, parts, after.busy - before.busy
