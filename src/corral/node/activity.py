"""When each sandbox was last used, for idle timeouts.

Kept in memory and flushed to the store on each housekeeping tick (one
batched UPDATE), so a command costs no write of its own. A sandbox running
a command is busy: busy sandboxes count as active at every flush, however
long the command runs.
"""

from __future__ import annotations

import time

from corral.node.store import Store


class Activity:
    def __init__(self, store: Store) -> None:
        self.store = store
        self._last: dict[str, float] = {}
        self._busy: dict[str, int] = {}

    def touch(self, sandbox_id: str) -> None:
        self._last[sandbox_id] = time.time()

    def begin(self, sandbox_id: str) -> None:
        """A command started in the sandbox."""
        self._busy[sandbox_id] = self._busy.get(sandbox_id, 0) + 1

    def end(self, sandbox_id: str) -> int:
        """A command ended; returns how many still run there."""
        left = self._busy[sandbox_id] - 1
        if left:
            self._busy[sandbox_id] = left
        else:
            del self._busy[sandbox_id]
        self.touch(sandbox_id)
        return left

    def running(self, sandbox_id: str) -> int:
        return self._busy.get(sandbox_id, 0)

    def forget(self, sandbox_id: str) -> None:
        self._last.pop(sandbox_id, None)

    def flush(self) -> None:
        """Record when each sandbox was last used (running commands count)."""
        now = time.time()
        for sid in self._busy:
            self._last[sid] = now
        if self._last:
            self.store.touch(self._last)
            self._last = {}
