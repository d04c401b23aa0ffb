"""A PostgreSQL server of Corral's own, for a cluster's state store.

`corral cluster up` and the tests start one from Debian's `postgresql`
package: a fresh cluster directory (initdb), owned by the `postgres` user
(initdb refuses root), password authentication over TCP only, and a
`corral` role and database. Where a PostgreSQL is already run by someone
else, pass its URL instead (`--state postgresql://...`) and none is started.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

from corral.errors import Unavailable
from corral.log import get_logger

log = get_logger("corral.postgres")


def _bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if found:
        return found[-1]
    path = shutil.which(name)
    if path is None:
        raise Unavailable(
            f"PostgreSQL's {name} is not installed (apt install postgresql); "
            "or pass --state postgresql://... of a running server"
        )
    return path


class LocalPostgres:
    def __init__(self, directory: Path, port: int = 5433) -> None:
        self.dir = directory
        self.data = directory / "data"
        self.port = port
        self.password_file = directory / "password"
        # Present from before initdb until the role and database exist: a
        # directory holding it is a half-made cluster (initdb cut short).
        self.making = directory / "initdb-in-progress"

    @property
    def url(self) -> str:
        password = self.password_file.read_text().strip()
        return f"postgresql://corral:{password}@127.0.0.1:{self.port}/corral"

    def _as_postgres(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            ["runuser", "-u", "postgres", "--", *argv],
            capture_output=True,
            text=True,
            cwd="/",
        )
        if check and r.returncode != 0:
            # One line naming the program and what it said, not a traceback.
            said = " | ".join((r.stderr or r.stdout).strip().splitlines()[-3:])[-500:]
            raise Unavailable(
                f"PostgreSQL's {Path(argv[0]).name} failed (exit {r.returncode}) for "
                f"{self.data}: {said or 'no output'}"
            )
        return r

    def running(self) -> bool:
        r = self._as_postgres(_bin("pg_ctl"), "status", "-D", str(self.data), check=False)
        return r.returncode == 0

    def start(self) -> str:
        """Start (initialising on first use); returns the URL to reach it."""
        self.dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o755)
        fresh = not (self.data / "PG_VERSION").exists() or self.making.exists()
        if fresh:
            self.stop()  # what a cut-short initdb may have left running
            if self.data.exists():
                shutil.rmtree(self.data)  # a half-made cluster from a failed initdb
            self.making.touch()
            self.data.mkdir()
            shutil.chown(self.data, "postgres", "postgres")
            self.password_file.write_text(secrets.token_urlsafe(18) + "\n")
            os.chmod(self.password_file, 0o600)
            self._as_postgres(
                _bin("initdb"), "-D", str(self.data), "-U", "postgres", "--auth-local=peer",
                "--auth-host=scram-sha-256", "-E", "UTF8",
            )  # fmt: skip
            with (self.data / "postgresql.conf").open("a") as conf:
                conf.write(
                    "\n# corral\nlisten_addresses = '127.0.0.1'\n"
                    f"port = {self.port}\nunix_socket_directories = '{self.data}'\n"
                    "max_connections = 300\n"
                    # A commit acknowledged is a commit kept, through a crash:
                    # the gateway tells a client "ready" only after its row
                    # is durable (asynchronous commit lost rows a create had
                    # already been told about, on `pg_ctl stop -m immediate`).
                    "fsync = on\nsynchronous_commit = on\n"
                )
        if not self.running():
            self._as_postgres(
                _bin("pg_ctl"), "start", "-w", "-t", "60", "-D", str(self.data),
                "-l", str(self.data / "server.log"),
            )  # fmt: skip
        if fresh:
            password = self.password_file.read_text().strip()
            self._psql(f"CREATE ROLE corral LOGIN PASSWORD '{password}'")
            self._psql("CREATE DATABASE corral OWNER corral")
            self.making.unlink()
        log.info("postgres.started", dir=str(self.data), port=self.port)
        return self.url

    def _psql(self, sql: str) -> None:
        self._as_postgres(
            _bin("psql"), "-h", str(self.data), "-p", str(self.port), "-d", "postgres",
            "-v", "ON_ERROR_STOP=1", "-c", sql,
        )  # fmt: skip

    def stop(self, mode: str = "fast") -> None:
        if not self.data.exists():
            return
        if self.running():
            r = self._as_postgres(
                _bin("pg_ctl"), "stop", "-w", "-m", mode, "-D", str(self.data), check=False
            )
            if r.returncode == 0:
                log.info("postgres.stopped", dir=str(self.data))
                return
        # Not a server pg_ctl stops: initdb's single-user backend, left by
        # an initdb cut short (it ends when its input closes), or a
        # postmaster pg_ctl cannot reach. Its pid is the lock file's first line.
        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() != "postgres":
                return  # a stale lock file: that pid is someone else's now
        except OSError:
            return
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        log.info("postgres.stopped", dir=str(self.data), pid=pid, how="signal")

    def restart(self) -> None:
        self.stop("immediate")
        time.sleep(0.1)
        self.start()
