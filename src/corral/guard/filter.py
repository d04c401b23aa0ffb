"""The seccomp profile compiled to a classic BPF program by libseccomp, laid
out as a binary tree over syscall numbers.

crun compiles a profile's rules with libseccomp's default layout: a chain
of comparisons, one per syscall, walked in order. Corral's allow-list
compiles to ~1,360 instructions that way, and the kernel pays for the
chain twice: on every syscall its action cache does not cover (those with
argument rules: ioctl, socket, clone, personality) the whole chain up to
the syscall runs, and when the filter is attached (once per sandbox) the
kernel fills that cache by emulating the filter for every syscall number
of each architecture, with interrupts off: 0.6-0.7 ms of a create here
(bench/results/seccomp-filter.md). With libseccomp's binary tree
(SCMP_FLTATR_CTL_OPTIMIZE = 2) each syscall reaches its rule in ~log2 of
the syscalls compared.

The program is what crun would build from profile()'s rules (the same
library, the same rule calls: crun's translation of an OCI profile, redone
here), only laid out differently; tests/unit/test_seccomp_filter.py checks
it against the policy itself, call by call, on every architecture. It is
handed to crun compiled (run.oci.seccomp_bpf_data), so crun parses no
rules. Where libseccomp cannot be loaded, None: crun compiles the rules as
before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import tempfile
from typing import Any

from corral.guard import seccomp
from corral.log import get_logger

log = get_logger("corral.guard.filter")

# libseccomp's ABI (seccomp.h), stable since 2.x.
_ACTIONS = {
    "SCMP_ACT_ALLOW": 0x7FFF0000,
    "SCMP_ACT_NOTIFY": 0x7FC00000,
    "SCMP_ACT_KILL_PROCESS": 0x80000000,
    "SCMP_ACT_KILL": 0x00000000,
}
_ACT_ERRNO = 0x00050000
_ARCHES = {"SCMP_ARCH_X86_64": 0xC000003E, "SCMP_ARCH_X86": 0x40000003, "SCMP_ARCH_X32": 0x4000003E}
_OPS = {
    "SCMP_CMP_NE": 1,
    "SCMP_CMP_LT": 2,
    "SCMP_CMP_LE": 3,
    "SCMP_CMP_EQ": 4,
    "SCMP_CMP_GE": 5,
    "SCMP_CMP_GT": 6,
    "SCMP_CMP_MASKED_EQ": 7,
}
_FLTATR_CTL_OPTIMIZE = 8
_BINARY_TREE = 2
_EEXIST = 17


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


class FilterError(Exception):
    """libseccomp refused a profile (a bug in the profile, not input)."""


@functools.cache
def _lib() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_arch_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp),
    ]  # fmt: skip
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def _action(rule: dict[str, Any]) -> int:
    name = rule["action"]
    if name == "SCMP_ACT_ERRNO":
        return _ACT_ERRNO | (int(rule.get("errnoRet", 1)) & 0xFFFF)
    return _ACTIONS[name]


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise FilterError(f"libseccomp: {what}: {os.strerror(-rc)}")


def compile_profile(profile: dict[str, Any], *, tree: bool = True) -> bytes | None:
    """The profile's rules as a classic BPF program (struct sock_filter
    array), or None where libseccomp is not there. A syscall name this
    libseccomp does not know is skipped, as crun skips it. Without `tree`,
    libseccomp's default layout: what crun itself compiles."""
    lib = _lib()
    if lib is None:
        log.info("filter.unavailable", why="libseccomp not found")
        return None
    default = _action(
        {"action": profile["defaultAction"], "errnoRet": profile.get("defaultErrnoRet", 1)}
    )
    ctx = lib.seccomp_init(default)
    if not ctx:
        raise FilterError("libseccomp: seccomp_init failed")
    try:
        for arch in profile["architectures"]:
            rc = lib.seccomp_arch_add(ctx, _ARCHES[arch])
            if rc != -_EEXIST:  # the native one is in already
                _check(rc, f"arch {arch}")
        if tree:
            _check(lib.seccomp_attr_set(ctx, _FLTATR_CTL_OPTIMIZE, _BINARY_TREE), "binary tree")
        for rule in profile["syscalls"]:
            if _action(rule) == default:
                continue  # libseccomp refuses them (EACCES); crun skips them too
            args = rule.get("args") or []
            cmps = (_ArgCmp * max(1, len(args)))(
                *(
                    _ArgCmp(a["index"], _OPS[a["op"]], a["value"], a.get("valueTwo", 0))
                    for a in args
                )
            )
            for name in rule["names"]:
                nr = lib.seccomp_syscall_resolve_name(name.encode())
                if nr < 0:
                    continue
                rc = lib.seccomp_rule_add_array(ctx, _action(rule), nr, len(args), cmps)
                _check(rc, f"rule for {name}")
        with tempfile.TemporaryFile() as out:
            _check(lib.seccomp_export_bpf(ctx, out.fileno()), "export")
            out.seek(0)
            return out.read()
    finally:
        lib.seccomp_release(ctx)


@functools.cache
def sandbox_filter() -> bytes | None:
    """seccomp.profile()'s rules, compiled once per process (~20 ms); None
    where this libseccomp cannot (before 2.5 it has no binary tree): crun
    then compiles the rules itself, as it did before."""
    try:
        return compile_profile(seccomp.profile("", ""))
    except FilterError as exc:
        log.warning("filter.unavailable", why=str(exc))
        return None
