"""What a container sandbox may see and do: capabilities, masked and
read-only paths. Shared by every container the node starts.

Masked paths are bind-mounted over with /dev/null (files) or an empty
read-only tmpfs (directories) by the OCI runtime; read-only paths are
remounted read-only. The list is Docker's default plus the kernel files that
crashed DSec hosts or leak host memory layout (/proc/kpage*, kcore, sysrq,
sched_debug, /sys/kernel with debugfs).
"""

from __future__ import annotations

# Docker's default set, minus what a sandbox without network and devices
# does not need (NET_RAW, MKNOD, AUDIT_WRITE, SETFCAP).
CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
]

MASKED_PATHS = [
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/kpagecount",
    "/proc/kpageflags",
    "/proc/kpagecgroup",
    "/proc/sysrq-trigger",
    "/proc/config.gz",
    "/proc/vmallocinfo",
    "/proc/slabinfo",
    "/proc/pagetypeinfo",
    "/sys/firmware",
    "/sys/kernel",
    "/sys/devices/virtual/powercap",
    "/sys/fs/bpf",
]

READONLY_PATHS = [
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
]
