"""host/spawn.py: helpers run to their end from the loop, always reaped."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from corral.host import spawn

pytestmark = pytest.mark.unit


def _zombies_of_ours() -> list[str]:
    """Our children that exited and were never reaped."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            out.append(pid)
    return out


async def test_exit_code_and_both_streams() -> None:
    done = await spawn.run(
        [
            sys.executable,
            "-c",
            "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)",
        ],
        stdout=True,
    )
    assert done == spawn.Finished(code=3, stdout=b"out\n", stderr=b"err\n")


async def test_stdout_is_not_kept_unless_asked() -> None:
    done = await spawn.run([sys.executable, "-c", "print('x' * 10)"])
    assert done.code == 0 and done.stdout == b""


async def test_a_killed_child_reports_its_signal() -> None:
    done = await spawn.run([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"])
    assert done.code == -9


async def test_a_flood_keeps_only_the_tail() -> None:
    n = spawn.LIMIT * 3
    code = f"import sys; sys.stderr.write('a' * {n}); sys.stderr.write('END')"
    done = await spawn.run([sys.executable, "-c", code])
    assert done.code == 0
    assert len(done.stderr) == spawn.LIMIT and done.stderr.endswith(b"aEND")


async def test_a_passed_fd_reaches_the_child() -> None:
    r, w = os.pipe()
    try:
        code = f"import os; os.write({w}, b'through')"
        done = await spawn.run([sys.executable, "-c", code], pass_fds=[w])
        assert done.code == 0
        assert os.read(r, 100) == b"through"
    finally:
        os.close(r)
        os.close(w)


async def test_an_unpassed_fd_does_not() -> None:
    r, w = os.pipe()
    try:
        code = f"import os; os.write({w}, b'leak')"
        done = await spawn.run([sys.executable, "-c", code])
        assert done.code == 1 and b"Bad file descriptor" in done.stderr
    finally:
        os.close(r)
        os.close(w)


async def test_a_timeout_kills_and_reaps() -> None:
    with pytest.raises(TimeoutError):
        await spawn.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)
    assert _zombies_of_ours() == []


async def test_a_cancelled_caller_returns_once_its_child_has_ended(tmp_path: Path) -> None:
    # What the helper makes after the cancel is there when the cancel
    # reaches its caller (a caller's cleanup then sees all of it).
    made = tmp_path / "made"
    code = f"import time; time.sleep(0.3); open({str(made)!r}, 'w').write('x')"
    task = asyncio.ensure_future(spawn.run([sys.executable, "-c", code]))
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert made.read_text() == "x"
    assert _zombies_of_ours() == []


async def test_a_cancelled_caller_waits_no_longer_than_the_timeout() -> None:
    task = asyncio.ensure_future(
        spawn.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)
    )
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):  # the caller's cancel, not the timeout
        await task
    assert _zombies_of_ours() == []


async def test_a_missing_binary_raises_at_once() -> None:
    with pytest.raises(FileNotFoundError):
        await spawn.run(["/nonexistent/helper"])


async def test_a_stuck_start_up_sweep_does_not_hold_the_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cgroups.sweep_beneath_cgroup2 runs rm through corral-nsexec before the
    node serves: one that never ends is killed at SWEEP_TIMEOUT and the
    start goes on (before, it had no bound)."""
    from corral.host import cgroups

    stuck = tmp_path / "nsexec"
    stuck.write_text('#!/bin/sh\necho $$ > "$0.pid"\nexec sleep 600\n')
    stuck.chmod(0o755)
    monkeypatch.setattr(cgroups, "SWEEP_TIMEOUT", 0.5)
    t0 = asyncio.get_running_loop().time()
    await cgroups.sweep_beneath_cgroup2(stuck, "corral-test")
    assert asyncio.get_running_loop().time() - t0 < 10
    pid = int((tmp_path / "nsexec.pid").read_text())
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped
    assert not _zombies_of_ours()
