"""The node agent's own child processes: their exit statuses must be
collected, or each dead sandbox leaves a zombie. Processes it started
itself (QEMU) are reaped in any process; sandbox inits only where it is
their subreaper (`corral serve`). An embedded caller's other children are
its own business: nothing here waits on a pid it was not given."""

from __future__ import annotations

import os
import subprocess

from corral.runtimes.base import Started


class Children:
    def __init__(self, reap: bool) -> None:
        self.reap_enabled = reap
        self._pids: set[int] = set()
        self._own: set[subprocess.Popen[bytes]] = set()

    def add(self, started: Started) -> None:
        if started.process is not None:
            # Started by this process (QEMU): its child whoever reaps the
            # rest, reaped through its Popen (which never waits on a pid
            # twice). Before, an embedded caller kept each closed VM as a
            # zombie until its next Popen happened to collect it.
            self._own.add(started.process)
        elif self.reap_enabled:
            self._pids.add(started.pid)

    def reap(self) -> None:
        """Collect the exit status of our sandboxes' dead init processes."""
        for proc in list(self._own):
            if proc.poll() is not None:
                self._own.discard(proc)
        for pid in list(self._pids):
            try:
                done, _status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid  # not ours (adopted before a restart) or gone
            if done:
                self._pids.discard(pid)
