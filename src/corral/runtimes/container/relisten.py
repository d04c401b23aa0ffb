"""A restored container's seccomp listeners, given back.

CRIU restores every task's seccomp filters but not the listener crun asked
for at create, so after a restore the syscalls the guard sends to
corral-seccompd would fail with ENOSYS, uncounted (and AIO, which seccompd
lets through within a budget, would be refused). native/corral-relisten.c
stops every task of the sandbox, has each stack the same filter again with
a new listener, and hands the listeners to seccompd. If it cannot (a task
that will not stop), the sandbox keeps the restored filters: refused
calls fail with ENOSYS, closed as before, and the reason is logged.
"""

from __future__ import annotations

import time
from pathlib import Path

from corral.host import spawn
from corral.log import get_logger

log = get_logger("corral.node")

TIMEOUT = 30.0  # the helper gives up on a task after 2 s; this bounds the rest


async def relisten(helper: Path, seccompd: Path, sandbox_id: str, task_files: list[Path]) -> int:
    """The number of listeners handed to seccompd; failures are logged."""
    t0 = time.monotonic()
    argv = [str(helper), "--socket", str(seccompd), "--id", sandbox_id, *map(str, task_files)]
    try:
        done = await spawn.run(argv, stdout=True, timeout=TIMEOUT)
        code, out, err = done.code, done.stdout, done.stderr
    except TimeoutError:  # killed: its tasks are detached as it exits
        code, out, err = -9, b"", f"no answer in {TIMEOUT:g} s".encode()
    try:
        listeners, stopped = (int(x) for x in out.split())
    except ValueError:
        listeners, stopped = 0, 0
    if code:
        log.warning("sandbox.relisten_failed", sandbox=sandbox_id, listeners=listeners,
                    tasks=stopped, detail=err.decode(errors="replace")[-500:])  # fmt: skip
    log.info("sandbox.relistened", sandbox=sandbox_id, listeners=listeners, tasks=stopped,
             ms=round((time.monotonic() - t0) * 1000, 1))  # fmt: skip
    return listeners
