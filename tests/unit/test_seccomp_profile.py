"""The seccomp profile's shape (what the kernel then enforces is tested in
tests/redteam)."""

from __future__ import annotations

import random

from corral.guard import seccomp
from corral.guard.seccompd import policy_lines, syscall_class


def test_the_ioctl_allow_rules_are_exactly_the_complement() -> None:
    prefixes = seccomp.allowed_prefixes(set(seccomp.EXTENT_IOCTLS))

    def allowed(v: int) -> bool:
        return sum(v & m == val for m, val in prefixes) == 1  # and never twice

    assert not any(any(v & m == val for m, val in prefixes) for v in seccomp.EXTENT_IOCTLS)
    rng = random.Random(7)
    for v in [
        0,
        0x5401,
        0x541B,
        0x80086601,
        0xFFFFFFFF,
        *(rng.getrandbits(32) for _ in range(20000)),
    ]:
        if v not in seccomp.EXTENT_IOCTLS:
            assert allowed(v), hex(v)


def test_profile_is_an_allow_list_that_notifies() -> None:
    p = seccomp.profile("/run/x.sock", "n-1")
    assert p["defaultAction"] == "SCMP_ACT_NOTIFY"
    assert p["listenerMetadata"] == "n-1"
    allowed = {
        n
        for r in p["syscalls"]
        if r["action"] == "SCMP_ACT_ALLOW" and "args" not in r
        for n in r["names"]
    }
    for name in (
        "mount",
        "unshare",
        "setns",
        "ptrace",
        "bpf",
        "keyctl",
        "userfaultfd",
        "perf_event_open",
        "kexec_load",
        "open_by_handle_at",
        "init_module",
        "io_uring_setup",
        "pidfd_getfd",
        "ioctl",
        "clone",
        "personality",
    ):
        assert name not in allowed, name
    for name in ("read", "openat", "execve", "clone", "futex", "socket", "getrandom"):
        assert name in allowed or any(name in r["names"] for r in p["syscalls"])
    masked = [
        r for r in p["syscalls"] if r["names"] == ["ioctl"] and r["action"] != "SCMP_ACT_ALLOW"
    ]
    assert {r["args"][0]["value"] for r in masked} == set(seccomp.EXTENT_IOCTLS)


def test_policy_and_classes() -> None:
    lines = dict(line.split() for line in policy_lines({}).splitlines())
    assert lines["165"] == "1" and lines["16"] == "1"  # mount, ioctl: EPERM
    assert syscall_class(165) == ("privileged", "mount")
    assert syscall_class(16) == ("extent-ioctl", "ioctl")
    assert syscall_class(56) == ("namespace", "clone")
    assert syscall_class(999)[0] == "other"


def test_a_profile_without_rules_keeps_what_the_compiled_filter_cannot_carry() -> None:
    """Handed the filter compiled (run.oci.seccomp_bpf_data), crun still
    needs where to send the notify listener and the sandbox it is for, and
    with a default of notify an unread rule list fails closed."""
    full, bare = (
        seccomp.profile("/run/a.sock", "s-1"),
        seccomp.profile("/run/a.sock", "s-1", rules=False),
    )
    assert bare["syscalls"] == [] and len(full["syscalls"]) > 100
    assert {k: v for k, v in bare.items() if k != "syscalls"} == {
        k: v for k, v in full.items() if k != "syscalls"
    }
    assert bare["defaultAction"] == "SCMP_ACT_NOTIFY"


def test_the_filter_key_names_the_rules_not_where_notices_go() -> None:
    import hashlib
    import json

    rules = {k: v for k, v in seccomp.profile("/x", "y").items() if not k.startswith("listener")}
    want = hashlib.sha256(json.dumps(rules, sort_keys=True).encode()).hexdigest()
    assert seccomp.filter_key() == want
    # Built once, never changed by a caller: two profiles share equal rules.
    assert seccomp.profile("/a", "1")["syscalls"] == seccomp.profile("/b", "2")["syscalls"]
