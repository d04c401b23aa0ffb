"""The daemon's policy (guard/seccompd.py) and the socket rules of the
profile (guard/seccomp.py): what a 32-bit call is counted as, what a socket
family gets."""

from __future__ import annotations

from pathlib import Path

from corral.guard import seccomp
from corral.guard.seccompd import i386_twins, policy_lines, syscall_class


def test_32_bit_calls_map_to_their_64_bit_twins() -> None:
    twins = i386_twins()
    # mount, ptrace, unshare, setns, bpf, socket: i386 -> x86_64
    for nr32, nr64 in ((21, 165), (26, 101), (310, 272), (346, 308), (357, 321), (359, 41)):
        assert twins[nr32] == nr64
    assert 102 not in twins  # socketcall has no x86_64 twin: it stays "other"


def test_headers_missing_means_no_twins_not_a_crash(tmp_path: Path) -> None:
    assert i386_twins(tmp_path) == {}


def test_the_policy_answers_families_with_eafnosupport_and_lists_twins() -> None:
    lines = policy_lines({21: 165}).splitlines()
    assert f"{seccomp.NR_SOCKET} 97" in lines and f"{seccomp.NR_SOCKETPAIR} 97" in lines
    assert "165 1" in lines and "i386 21 165" in lines


def test_socket_refusals_have_their_own_class() -> None:
    assert syscall_class(41) == ("socket-family", "socket")
    assert syscall_class(53) == ("socket-family", "socketpair")


def test_the_profile_allows_exactly_the_needed_families() -> None:
    rules = [r for r in seccomp.profile("/l", "s")["syscalls"] if "socket" in r["names"]]
    allowed = set()
    for rule in rules:
        assert rule["action"] == "SCMP_ACT_ALLOW" and rule["names"] == ["socket", "socketpair"]
        args = {a["index"]: a["value"] for a in rule["args"]}
        allowed.add((args[0], args.get(2)))
    assert allowed == {(1, None), (2, None), (10, None), (16, 0)}
    assert "socket" not in seccomp.ALLOWED and "socketpair" not in seccomp.ALLOWED


def test_aio_has_a_budget_and_posix_queues_are_refused() -> None:
    lines = policy_lines({}, aio_events=1234).splitlines()
    assert "aio 1234" in lines and f"{seccomp.NR_IO_SETUP} 11" in lines
    assert f"{seccomp.NR_MQ_OPEN} 1" in lines
    assert "io_setup" not in seccomp.ALLOWED and "mq_open" not in seccomp.ALLOWED
    assert syscall_class(seccomp.NR_IO_SETUP) == ("kernel-quota", "io_setup")
    assert syscall_class(seccomp.NR_MQ_OPEN) == ("kernel-quota", "mq_open")
