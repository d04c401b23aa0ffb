"""corral-nsexec --limits-of: the program (crun run) runs as its child, and
once it has exited 0 the kernel counter limits are written in the user
namespace of the process named by the pid file. (End to end, from inside
a sandbox: tests/redteam/test_review.py's kernel counter test.)"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.host import sealed

NSEXEC = Path(__file__).resolve().parents[2] / "build" / "platform" / "bin" / "corral-nsexec"


@pytest.fixture
def nsexec() -> Path:
    if not NSEXEC.is_file():
        pytest.fail(f"{NSEXEC} is missing: make -C native builds it")
    return NSEXEC


@pytest.fixture
def in_userns() -> Iterator[int]:
    """A process in a user namespace of its own (a stand-in for a sandbox's init)."""
    proc = subprocess.Popen(["unshare", "--user", "--map-root-user", "sleep", "60"])
    try:
        # Until unshare has made the namespace, mapped root and exec'd sleep.
        # The ns links are compared by their text ("user:[inode]"): resolving
        # them as paths gives names that always differ, and a test that went on
        # before the unshare entered our own namespace (EINVAL, a CI flake).
        ours = os.readlink("/proc/self/ns/user")
        for _ in range(500):
            if (
                os.readlink(f"/proc/{proc.pid}/ns/user") != ours
                and Path(f"/proc/{proc.pid}/comm").read_text().strip() == "sleep"
            ):
                break
            time.sleep(0.01)
        else:
            pytest.fail("unshare --user did not start sleep in a namespace of its own in 5 s")
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _limit(pid: int, name: str) -> str:
    out = subprocess.run(
        ["nsenter", "--user", "-t", str(pid), "cat", f"/proc/sys/user/{name}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return out.stdout.strip()


def _run(nsexec: Path, pid_file: Path, *program: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(nsexec), "--limits-of", str(pid_file), "--limit", "max_inotify_instances=7",
         "--limit", "max_inotify_watches=99", "--", *program],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip


def test_limits_are_set_in_the_started_process_namespace(
    nsexec: Path, in_userns: int, tmp_path: Path
) -> None:
    pid_file = tmp_path / "init.pid"
    pid_file.write_text(f"{in_userns}\n")
    before = _limit(in_userns, "max_inotify_instances")
    done = _run(nsexec, pid_file, "true")
    assert done.returncode == 0, done.stderr
    assert before != "7"
    assert (
        _limit(in_userns, "max_inotify_instances"),
        _limit(in_userns, "max_inotify_watches"),
    ) == (
        "7",
        "99",
    )


def test_a_failed_program_sets_nothing_and_its_status_is_passed_on(
    nsexec: Path, in_userns: int, tmp_path: Path
) -> None:
    pid_file = tmp_path / "init.pid"
    pid_file.write_text(str(in_userns))
    done = _run(nsexec, pid_file, "sh", "-c", "exit 3")
    assert done.returncode == 3
    assert _limit(in_userns, "max_inotify_instances") != "7"


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (None, "opening"),  # the program wrote no pid file
        ("", "reading"),  # an empty one
        ("999999999", "/proc/999999999/ns/user"),  # a pid that is not there
    ],
)
def test_a_pid_file_that_names_no_process_is_an_error(
    nsexec: Path, tmp_path: Path, content: str | None, said: str
) -> None:
    pid_file = tmp_path / "init.pid"
    if content is not None:
        pid_file.write_text(content)
    done = _run(nsexec, pid_file, "true")
    assert done.returncode == 125
    assert said in done.stderr and "corral-nsexec" in done.stderr, done.stderr


def test_the_program_runs_from_the_sealed_copy_it_is_handed_and_keeps_no_fd_of_it(
    nsexec: Path,
) -> None:
    # How the agent runs crun: from one sealed memfd (host/sealed.py), which
    # crun then takes for its own clone instead of copying itself per call.
    ls = sealed.sealed_copy("/bin/ls")
    assert ls is not None
    try:
        done = subprocess.run(
            [str(nsexec), "--exec-fd", str(ls), "--", "ls", "-l", "/proc/self/exe", "/proc/self/fd"],
            capture_output=True, text=True, timeout=30, pass_fds=[ls],
        )  # fmt: skip
    finally:
        os.close(ls)
    assert done.returncode == 0, done.stderr
    exe, _, fds = done.stdout.partition("/proc/self/fd:")
    assert "/memfd:ls" in exe
    # 0-2, and the directory ls is reading: the memfd was closed on exec.
    assert {line.split()[8] for line in fds.strip().splitlines()[1:]} <= {"0", "1", "2", "3"}


def _userns_holders(nsexec: Path) -> list[int]:
    """corral-nsexec's forked user-namespace holders (they keep its argv)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and (d / "exe").resolve() == nsexec.resolve():
                found.append(int(d.name))
        except OSError:
            continue
    return found


def test_a_user_namespace_holder_ends_with_a_failed_corral_nsexec(
    nsexec: Path, tmp_path: Path
) -> None:
    # A map the kernel refuses (size 0) kills corral-nsexec after it has
    # forked the child that holds the namespace: the child must not wait on.
    dirs = [tmp_path / n for n in ("lower", "upper", "work", "root", "stage")]
    for d in dirs:
        d.mkdir()
    lower, upper, work, root, stage = (str(d) for d in dirs)
    r = subprocess.run(
        [str(nsexec), "--overlay", lower, upper, work, root, "--idmap", "100000:0",
         "--stage", stage, "--", "true"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert r.returncode != 0 and "uid_map" in r.stderr, r.stderr
    for _ in range(100):
        if not _userns_holders(nsexec):
            break
        subprocess.run(["sleep", "0.02"], check=True)
    assert _userns_holders(nsexec) == []
