"""The sandbox's seccomp filter as Corral compiles it (guard/filter.py: a
binary tree) decides every call as libseccomp's default layout does (what
crun compiles): both programs are run here, by a classic BPF interpreter
for seccomp_data, on every syscall number of each architecture, with
batteries of arguments for the calls whose rules read them; and the
policy's own cases answer as docs/guard.md says. No root: libseccomp
compiles, nothing is attached."""

from __future__ import annotations

import random
import struct

import pytest

from corral.guard import filter as seccomp_filter
from corral.guard import seccomp

if seccomp_filter._lib() is None:
    pytest.skip("requires libseccomp (libseccomp2, a dependency of crun)", allow_module_level=True)

X86_64, I386, AARCH64 = 0xC000003E, 0x40000003, 0xC00000B7
X32 = 0x40000000  # the x32 ABI: x86_64's arch, this bit in the number
ALLOW, NOTIFY, ERRNO = 0x7FFF0000, 0x7FC00000, 0x00050000
MASK32 = 0xFFFFFFFF


def run(prog: bytes, nr: int, arch: int, args: tuple[int, ...] = ()) -> int:
    """What the filter returns for one call (struct seccomp_data)."""
    return walk(prog, nr, arch, args)[0]


def walk(prog: bytes, nr: int, arch: int, args: tuple[int, ...] = ()) -> tuple[int, int]:
    """(what the filter returns, how many instructions it ran)."""
    full = (*args, *(0,) * (6 - len(args)))
    data = struct.pack("<iIQ6Q", nr, arch, 0, *full)
    a, pc, steps = 0, 0, 0
    while True:
        code, jt, jf, k = struct.unpack_from("<HBBI", prog, pc * 8)
        pc += 1
        steps += 1
        if code == 0x20:  # ld [k]
            (a,) = struct.unpack_from("<I", data, k)
        elif code == 0x54:  # and #k
            a &= k
        elif code == 0x05:  # ja
            pc += k
        elif code in (0x15, 0x25, 0x35, 0x45):  # jeq, jgt, jge, jset
            hit = {0x15: a == k, 0x25: a > k, 0x35: a >= k, 0x45: bool(a & k)}[code]
            pc += jt if hit else jf
        elif code == 0x06:  # ret #k
            return k, steps
        else:
            raise AssertionError(f"opcode {code:#x} at {pc - 1}: not interpreted here")


@pytest.fixture(scope="module")
def programs() -> tuple[bytes, bytes]:
    prof = seccomp.profile("", "")
    tree = seccomp_filter.compile_profile(prof)
    linear = seccomp_filter.compile_profile(prof, tree=False)
    assert tree is not None and linear is not None
    return tree, linear


def _batteries() -> list[tuple[int, ...]]:
    """Arguments that reach each branch of the argument rules (ioctl,
    socket, socketpair, clone, personality), upper bits included."""
    cmds = [*seccomp.EXTENT_IOCTLS, 0x5401, 0x541B, 0xC0189436 ^ 1, 0x40049408, 0]
    out: list[tuple[int, ...]] = []
    for cmd in cmds:
        out += [(3, cmd), (3, cmd | 1 << 32), (3, cmd | 0xFFFFFFFF << 32)]
    for family in range(0, 46):
        for protocol in (0, 1, 9, 15):
            out += [(family, 1, protocol), (family | 1 << 32, 1, protocol)]
    for flags in (0, 17, 0x10000000, 0x40000000, 0x00020000, 0x003D0F00, 0x7E020000, 1 << 33):
        out.append((flags,))
    for p in (*seccomp.PERSONALITIES, 1, 0x0400000, 0x20000 | 1 << 32):
        out.append((p,))
    return out


def test_the_tree_decides_every_call_as_crun_would(programs: tuple[bytes, bytes]) -> None:
    tree, linear = programs
    rng = random.Random(20)
    noise = [tuple(rng.getrandbits(64) for _ in range(6)) for _ in range(2)]
    calls: list[tuple[int, int, tuple[int, ...]]] = []
    for arch, base in ((X86_64, 0), (I386, 0), (X86_64, X32), (AARCH64, 0)):
        for nr in range(0, 560):
            for args in ((), *noise):
                calls.append((base | nr, arch, args))
    # the calls whose rules read arguments, on each ABI (i386: socketcall 102 too)
    special = {X86_64: (16, 41, 53, 56, 135), I386: (54, 102, 120, 136, 359, 360)}
    for arch, nrs in special.items():
        for nr in nrs:
            calls += [(nr, arch, args) for args in _batteries()]
    calls += [(X32 | nr, X86_64, args) for nr in (16, 41, 53, 56, 135) for args in _batteries()]
    differ = [c for c in calls if run(tree, *c) != run(linear, *c)]
    assert not differ, f"{len(differ)} calls decided differently, first: {differ[:5]}"


@pytest.mark.parametrize(
    ("nr", "arch", "args", "expected"),
    [
        (0, X86_64, (), ALLOW),  # read
        (165, X86_64, (), NOTIFY),  # mount: refused, counted
        (101, X86_64, (), NOTIFY),  # ptrace
        (425, X86_64, (), NOTIFY),  # io_uring_setup
        (56, X86_64, (17,), ALLOW),  # clone(SIGCHLD)
        (56, X86_64, (0x10000000 | 17,), NOTIFY),  # clone(CLONE_NEWUSER)
        (435, X86_64, (), ERRNO | 38),  # clone3: ENOSYS, glibc falls back
        (16, X86_64, (1, 0x5401), ALLOW),  # ioctl TCGETS
        (16, X86_64, (3, 0x40049409), NOTIFY),  # ioctl FICLONE
        (16, X86_64, (3, 0x5401 | 1 << 32), NOTIFY),  # a command with upper bits
        (41, X86_64, (1, 1, 0), ALLOW),  # socket(AF_UNIX)
        (41, X86_64, (40, 1, 0), NOTIFY),  # socket(AF_VSOCK): reaches the host
        (41, X86_64, (16, 3, 0), ALLOW),  # netlink route
        (41, X86_64, (16, 3, 9), NOTIFY),  # netlink audit
        (135, X86_64, (0,), ALLOW),  # personality(PER_LINUX)
        (135, X86_64, (0x0400000,), NOTIFY),  # READ_IMPLIES_EXEC
        (3, I386, (), ALLOW),  # i386 read
        (21, I386, (), NOTIFY),  # i386 mount
        (X32 | 0, X86_64, (), ALLOW),  # x32 read
    ],
)
def test_the_policy_answers_as_documented(
    programs: tuple[bytes, bytes], nr: int, arch: int, args: tuple[int, ...], expected: int
) -> None:
    tree, _ = programs
    assert run(tree, nr, arch, args) == expected


def test_an_unknown_architecture_is_killed(programs: tuple[bytes, bytes]) -> None:
    tree, _ = programs
    assert run(tree, 0, AARCH64) & 0xFFFF0000 in (0, 0x80000000)  # KILL_THREAD/PROCESS


def test_the_tree_is_shorter_to_walk(programs: tuple[bytes, bytes]) -> None:
    """The kernel's cost: the instructions that reach each syscall's
    answer, which its action cache emulates for every number at attach."""
    tree, linear = programs
    tree_steps = sum(walk(tree, nr, X86_64)[1] for nr in range(0, 450))
    linear_steps = sum(walk(linear, nr, X86_64)[1] for nr in range(0, 450))
    assert tree_steps * 5 < linear_steps, (tree_steps, linear_steps)


def test_a_libseccomp_that_cannot_compile_leaves_it_to_crun(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(profile: object, *, tree: bool = True) -> bytes:
        raise seccomp_filter.FilterError("libseccomp: binary tree: Invalid argument")

    seccomp_filter.sandbox_filter.cache_clear()
    monkeypatch.setattr(seccomp_filter, "compile_profile", refuse)
    try:
        assert seccomp_filter.sandbox_filter() is None
    finally:
        seccomp_filter.sandbox_filter.cache_clear()
