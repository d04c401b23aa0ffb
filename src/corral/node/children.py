"""The node agent's own child processes (sandbox inits, QEMUs), where it
is their subreaper (`corral serve`): their exit statuses must be collected,
or each dead sandbox leaves a zombie. Never used in an embedded caller's
process, whose children are its own business."""

from __future__ import annotations

import os


class Children:
    def __init__(self, reap: bool) -> None:
        self.reap_enabled = reap
        self._pids: set[int] = set()

    def add(self, pid: int) -> None:
        if self.reap_enabled:
            self._pids.add(pid)

    def reap(self) -> None:
        """Collect the exit status of our sandboxes' dead init processes."""
        for pid in list(self._pids):
            try:
                done, _status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid  # not ours (adopted before a restart) or gone
            if done:
                self._pids.discard(pid)
