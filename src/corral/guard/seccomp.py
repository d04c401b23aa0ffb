"""The seccomp profile of a container sandbox (x86_64).

An allow-list, at least as strict as Docker's default: every syscall not
listed (including any the kernel adds later) is refused. Refusals are not
silent: they go to the node agent as seccomp user notifications, which
counts them per sandbox and class (the audit) and answers EPERM, or ENOSYS
for syscalls that are merely unknown here. With no agent listening the
kernel answers ENOSYS: still refused.

Beyond Docker's list: ioctl commands that clone, deduplicate or swap file
extents (the DSec incident where an agent pulled a protected file's data
into its own file and corrupted the file system) are refused by argument;
ptrace, the mount API and io_uring are refused outright. Sockets are
allowed only in the families a sandbox needs (unix, inet, inet6, and
netlink's route protocol for tools like `ip`): any other family (vsock,
which reaches the host, packet, bluetooth, ...) is refused with
EAFNOSUPPORT and counted. io_setup is let through by the daemon within
each sandbox's budget of AIO events, refused with EAGAIN past it; POSIX
message queues (mq_open) are refused (NR_MQ_OPEN says why).
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

# Unconditionally allowed (x86_64 names, as libseccomp spells them).
ALLOWED = [
    "read",
    "write",
    "open",
    "close",
    "stat",
    "fstat",
    "lstat",
    "poll",
    "lseek",
    "mmap",
    "mprotect",
    "munmap",
    "brk",
    "rt_sigaction",
    "rt_sigprocmask",
    "rt_sigreturn",
    "pread64",
    "pwrite64",
    "readv",
    "writev",
    "access",
    "pipe",
    "select",
    "sched_yield",
    "mremap",
    "msync",
    "mincore",
    "madvise",
    "shmget",
    "shmat",
    "shmctl",
    "dup",
    "dup2",
    "pause",
    "nanosleep",
    "getitimer",
    "alarm",
    "setitimer",
    "getpid",
    "sendfile",
    "connect",
    "accept",
    "sendto",
    "recvfrom",
    "sendmsg",
    "recvmsg",
    "shutdown",
    "bind",
    "listen",
    "getsockname",
    "getpeername",
    "setsockopt",
    "getsockopt",
    "fork",
    "vfork",
    "execve",
    "exit",
    "wait4",
    "kill",
    "uname",
    "semget",
    "semop",
    "semctl",
    "shmdt",
    "msgget",
    "msgsnd",
    "msgrcv",
    "msgctl",
    "fcntl",
    "flock",
    "fsync",
    "fdatasync",
    "truncate",
    "ftruncate",
    "getdents",
    "getcwd",
    "chdir",
    "fchdir",
    "rename",
    "mkdir",
    "rmdir",
    "creat",
    "link",
    "unlink",
    "symlink",
    "readlink",
    "chmod",
    "fchmod",
    "chown",
    "fchown",
    "lchown",
    "umask",
    "gettimeofday",
    "getrlimit",
    "getrusage",
    "sysinfo",
    "times",
    "getuid",
    "getgid",
    "setuid",
    "setgid",
    "geteuid",
    "getegid",
    "setpgid",
    "getppid",
    "getpgrp",
    "setsid",
    "setreuid",
    "setregid",
    "getgroups",
    "setgroups",
    "setresuid",
    "getresuid",
    "setresgid",
    "getresgid",
    "getpgid",
    "setfsuid",
    "setfsgid",
    "getsid",
    "capget",
    "capset",
    "rt_sigpending",
    "rt_sigtimedwait",
    "rt_sigqueueinfo",
    "rt_sigsuspend",
    "sigaltstack",
    "utime",
    "mknod",
    "statfs",
    "fstatfs",
    "getpriority",
    "setpriority",
    "sched_setparam",
    "sched_getparam",
    "sched_setscheduler",
    "sched_getscheduler",
    "sched_get_priority_max",
    "sched_get_priority_min",
    "sched_rr_get_interval",
    "mlock",
    "munlock",
    "mlockall",
    "munlockall",
    "modify_ldt",
    "prctl",
    "arch_prctl",
    "adjtimex",
    "setrlimit",
    "chroot",
    "sync",
    "gettid",
    "readahead",
    "setxattr",
    "lsetxattr",
    "fsetxattr",
    "getxattr",
    "lgetxattr",
    "fgetxattr",
    "listxattr",
    "llistxattr",
    "flistxattr",
    "removexattr",
    "lremovexattr",
    "fremovexattr",
    "tkill",
    "time",
    "futex",
    "sched_setaffinity",
    "sched_getaffinity",
    "set_thread_area",
    "io_destroy",
    "io_getevents",
    "io_submit",
    "io_cancel",
    "get_thread_area",
    "epoll_create",
    "remap_file_pages",
    "getdents64",
    "set_tid_address",
    "restart_syscall",
    "semtimedop",
    "fadvise64",
    "timer_create",
    "timer_settime",
    "timer_gettime",
    "timer_getoverrun",
    "timer_delete",
    "clock_gettime",
    "clock_getres",
    "clock_nanosleep",
    "exit_group",
    "epoll_wait",
    "epoll_ctl",
    "tgkill",
    "utimes",
    "mq_unlink",
    "mq_timedsend",
    "mq_timedreceive",
    "mq_notify",
    "mq_getsetattr",
    "waitid",
    "ioprio_set",
    "ioprio_get",
    "inotify_init",
    "inotify_add_watch",
    "inotify_rm_watch",
    "openat",
    "mkdirat",
    "mknodat",
    "fchownat",
    "futimesat",
    "newfstatat",
    "unlinkat",
    "renameat",
    "linkat",
    "symlinkat",
    "readlinkat",
    "fchmodat",
    "faccessat",
    "pselect6",
    "ppoll",
    "set_robust_list",
    "get_robust_list",
    "splice",
    "tee",
    "sync_file_range",
    "vmsplice",
    "utimensat",
    "epoll_pwait",
    "signalfd",
    "timerfd_create",
    "eventfd",
    "fallocate",
    "timerfd_settime",
    "timerfd_gettime",
    "accept4",
    "signalfd4",
    "eventfd2",
    "epoll_create1",
    "dup3",
    "pipe2",
    "inotify_init1",
    "preadv",
    "pwritev",
    "rt_tgsigqueueinfo",
    "recvmmsg",
    "fanotify_mark",
    "prlimit64",
    "syncfs",
    "sendmmsg",
    "getcpu",
    "sched_setattr",
    "sched_getattr",
    "renameat2",
    "seccomp",
    "getrandom",
    "memfd_create",
    "execveat",
    "membarrier",
    "mlock2",
    "copy_file_range",
    "preadv2",
    "pwritev2",
    "pkey_mprotect",
    "pkey_alloc",
    "pkey_free",
    "statx",
    "io_pgetevents",
    "rseq",
    "pidfd_send_signal",
    "pidfd_open",
    "close_range",
    "openat2",
    "faccessat2",
    "epoll_pwait2",
    "landlock_create_ruleset",
    "landlock_add_rule",
    "landlock_restrict_self",
    "memfd_secret",
    "process_mrelease",
    "futex_waitv",
]

# Refused syscalls by class, for the audit (x86_64 numbers).
PRIVILEGED = {
    163: "acct",
    248: "add_key",
    321: "bpf",
    305: "clock_adjtime",
    227: "clock_settime",
    164: "settimeofday",
    174: "create_module",
    176: "delete_module",
    313: "finit_module",
    175: "init_module",
    177: "get_kernel_syms",
    178: "query_module",
    246: "kexec_load",
    320: "kexec_file_load",
    250: "keyctl",
    249: "request_key",
    212: "lookup_dcookie",
    165: "mount",
    166: "umount2",
    155: "pivot_root",
    429: "move_mount",
    428: "open_tree",
    430: "fsopen",
    431: "fsconfig",
    432: "fsmount",
    433: "fspick",
    442: "mount_setattr",
    272: "unshare",
    308: "setns",
    101: "ptrace",
    310: "process_vm_readv",
    311: "process_vm_writev",
    312: "kcmp",
    298: "perf_event_open",
    323: "userfaultfd",
    304: "open_by_handle_at",
    303: "name_to_handle_at",
    169: "reboot",
    167: "swapon",
    168: "swapoff",
    179: "quotactl",
    443: "quotactl_fd",
    103: "syslog",
    153: "vhangup",
    172: "iopl",
    173: "ioperm",
    180: "nfsservctl",
    134: "uselib",
    136: "ustat",
    139: "sysfs",
    156: "_sysctl",
    237: "mbind",
    238: "set_mempolicy",
    239: "get_mempolicy",
    279: "move_pages",
    256: "migrate_pages",
    450: "set_mempolicy_home_node",
    438: "pidfd_getfd",
    300: "fanotify_init",
    425: "io_uring_setup",
    426: "io_uring_enter",
    427: "io_uring_register",
    440: "process_madvise",
    170: "sethostname",
    171: "setdomainname",
}
NR_IOCTL, NR_CLONE, NR_PERSONALITY, NR_CLONE3 = 16, 56, 135, 435
NR_SOCKET, NR_SOCKETPAIR = 41, 53
# io_setup goes to the daemon, which lets it through within the sandbox's
# budget of AIO events (one host-wide pool, fs.aio-max-nr, has no shares).
NR_IO_SETUP = 206
EAGAIN = 11
# POSIX message queues: their bytes are charged to the account of whoever
# made the sandbox's user namespace (the host root's), whose ceiling only
# CAP_SYS_RESOURCE could lift: one sandbox would exhaust it for all. Refused
# (SysV queues, per IPC namespace, are not affected).
NR_MQ_OPEN = 240
EAFNOSUPPORT = 97
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK = 1, 2, 10, 16
NETLINK_ROUTE = 0
# (family, protocol or None for any): what socket() and socketpair() may make.
SOCKET_FAMILIES = ((AF_UNIX, None), (AF_INET, None), (AF_INET6, None), (AF_NETLINK, NETLINK_ROUTE))

# ioctl commands that clone, deduplicate or swap extents between files.
EXTENT_IOCTLS = {
    0x40049409: "FICLONE",
    0x4020940D: "FICLONERANGE",
    0xC0189436: "FIDEDUPERANGE",
    0xC0C0586D: "XFS_IOC_SWAPEXT",
    0x40285881: "FS_IOC_EXCHANGE_RANGE",
    0xC028660F: "EXT4_IOC_MOVE_EXT",
    0xC020F509: "F2FS_IOC_MOVE_RANGE",
}
CLONE_NAMESPACES = 0x7E020000  # CLONE_NEW{NS,UTS,IPC,USER,PID,NET,CGROUP}
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)  # Docker's: linux, 32-bit, query
U32_MAX = 0xFFFFFFFF
ACT_NOTIFY = "SCMP_ACT_NOTIFY"


def classify(nr: int, args: tuple[int, ...]) -> tuple[str, str, int]:
    """(class, name, errno to answer) of a refused syscall."""
    if nr in PRIVILEGED:
        return "privileged", PRIVILEGED[nr], 1  # EPERM
    if nr == NR_IOCTL:
        cmd = args[1]
        return "extent-ioctl", EXTENT_IOCTLS.get(cmd & U32_MAX, f"ioctl {cmd:#x}"), 1
    if nr == NR_CLONE:
        return "namespace", "clone", 1
    if nr == NR_PERSONALITY:
        return "privileged", "personality", 1
    if nr in (NR_SOCKET, NR_SOCKETPAIR):
        return "socket-family", f"socket family {args[0]}", EAFNOSUPPORT
    if nr == NR_CLONE3:
        return "other", "clone3", 38  # ENOSYS: glibc falls back to clone
    return "other", f"syscall {nr}", 38


def allowed_prefixes(denied: set[int], bits: int = 32) -> list[tuple[int, int]]:
    """(mask, value) pairs whose matches, `arg & mask == value`, are exactly
    the `bits`-wide values not in `denied`: the complement of the set as
    the sibling subtrees of a binary trie over its members."""
    out: list[tuple[int, int]] = []

    def walk(prefix: int, depth: int, members: list[int]) -> None:
        if not members:
            out.append((((1 << depth) - 1) << (bits - depth), prefix))
            return
        if depth == bits:
            return  # a denied value itself
        bit = 1 << (bits - depth - 1)
        for b in (0, bit):
            walk(prefix | b, depth + 1, [m for m in members if m & bit == b])

    walk(0, 0, sorted(denied))
    return out


def _ioctl_rules() -> list[dict[str, Any]]:
    """Allow ioctl for every 32-bit command but the extent ones, which are
    refused and counted. The allowed set is spelled as disjoint masked
    comparisons (allowed_prefixes), so no two rules ever match one call: how
    libseccomp resolves overlapping rules of different actions depends on
    how many there are (measured: an allow-all plus seven equality rules let
    FICLONE through). Every mask also covers the upper 32 bits, which must
    be 0: the kernel truncates the argument to 32 bits, so a command with
    upper bits set would otherwise slip past."""
    rules: list[dict[str, Any]] = [
        {
            "names": ["ioctl"],
            "action": "SCMP_ACT_ALLOW",
            "args": [
                {
                    "index": 1,
                    "value": (0xFFFFFFFF << 32) | mask,
                    "valueTwo": value,
                    "op": "SCMP_CMP_MASKED_EQ",
                }
            ],
        }
        for mask, value in allowed_prefixes(set(EXTENT_IOCTLS))
    ]
    rules += [
        {
            "names": ["ioctl"],
            "action": ACT_NOTIFY,
            "args": [{"index": 1, "value": cmd, "op": "SCMP_CMP_EQ"}],
        }
        for cmd in sorted(EXTENT_IOCTLS)
    ]
    return rules


def _socket_rules() -> list[dict[str, Any]]:
    """socket() and socketpair() in the allowed families only; the rest go
    to the daemon (refused, counted). Equality on the whole 64-bit
    argument: a family with upper bits set matches no rule, so it is
    refused too, although the kernel would read only the low 32 bits."""
    rules = []
    for family, protocol in SOCKET_FAMILIES:
        args = [{"index": 0, "value": family, "op": "SCMP_CMP_EQ"}]
        if protocol is not None:
            args.append({"index": 2, "value": protocol, "op": "SCMP_CMP_EQ"})
        rules.append({"names": ["socket", "socketpair"], "action": "SCMP_ACT_ALLOW", "args": args})
    return rules


def profile(listener_path: str, sandbox_id: str, *, rules: bool = True) -> dict[str, Any]:
    """The OCI `linux.seccomp` object. crun hands the notification fd to
    the agent listening at listener_path, with sandbox_id as metadata.
    Without `rules` it has no syscall list: for a runtime handed the
    filter already compiled (whose key is filter_key()), which then need
    not parse 30 KB of rules per sandbox."""
    return {
        "defaultAction": ACT_NOTIFY,
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "listenerPath": listener_path,
        "listenerMetadata": sandbox_id,
        "syscalls": list(_rules()) if rules else [],
    }


@functools.cache
def filter_key() -> str:
    """Names the filter profile() compiles to (its rules, default action
    and architectures; not where notifications go)."""
    doc = {k: v for k, v in profile("", "").items() if not k.startswith("listener")}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


@functools.cache
def _rules() -> tuple[dict[str, Any], ...]:
    """The rules, built once: the same for every sandbox (callers must not
    change them)."""
    rules = _ioctl_rules() + _socket_rules()
    rules.append({"names": ALLOWED, "action": "SCMP_ACT_ALLOW"})
    rules.append(
        {
            "names": ["clone"],
            "action": "SCMP_ACT_ALLOW",
            "args": [
                {"index": 0, "value": CLONE_NAMESPACES, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}
            ],
        }
    )
    rules += [
        {
            "names": ["personality"],
            "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": p, "op": "SCMP_CMP_EQ"}],
        }
        for p in PERSONALITIES
    ]
    # clone3 passes its flags in memory, where seccomp cannot look: refuse
    # it as unknown (ENOSYS) in the kernel, uncounted; glibc uses clone.
    rules.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38})
    return tuple(rules)
