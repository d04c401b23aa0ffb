"""The OCI runtime bundle (config.json) of a container sandbox."""

from __future__ import annotations

import functools
import os
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.guard import profile
from corral.host import platform
from corral.host.cgroups import IoLimit

CPU_PERIOD = 100_000
IDS = 65536  # host ids per sandbox user namespace


@dataclass(frozen=True)
class BundleSpec:
    sandbox_id: str
    rootfs: Path
    platform_dir: Path
    env: list[str]
    cpu: float
    memory: int
    pids: int
    cgroups_path: str
    swap_accounting: bool
    seccomp: dict[str, Any] | None = None
    host_id: int | None = None  # user namespace: container 0..65535 = host_id..+65535
    # A function-call worker: the root is read-only and these (path, bytes)
    # tmpfs mounts are the only places a call can write.
    readonly_root: bool = False
    tmpfs: tuple[tuple[str, int], ...] = ()
    io: IoLimit | None = None
    # cgroup v1: the memory cgroup's swappiness. 0 keeps a running sandbox
    # out of swap (the host may have some for suspended ones); v2 has no
    # such knob (its swap.max is 0 through memory+swap == memory).
    swappiness: int | None = None
    # An empty read-only host directory: masked directories are bound to
    # it instead of each getting a tmpfs of its own (see masks()).
    empty_dir: Path | None = None
    # cgroup v1: /sys/fs/cgroup as a bind of this read-only skeleton with
    # the sandbox's own cgroup directories (hierarchy name, host path)
    # bound on it (cgroup_mounts()); None: crun mounts it.
    cgroup_skeleton: Path | None = None
    cgroup_dirs: tuple[tuple[str, Path], ...] = ()


def _nofile_limit() -> int:
    # A spec asking for more than the host's hard limit fails setrlimit
    # (HOST-NOTES: 20000 here; podman's defaults trip on it).
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return min(hard if hard != resource.RLIM_INFINITY else 1 << 20, 1 << 20)


def _has_cap_sys_resource() -> bool:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 24 & 1)
    return False


# Lowering an OOM score needs CAP_SYS_RESOURCE, which some hosts withhold
# even from root (these development VMs do).
CAN_PROTECT_INIT = _has_cap_sys_resource()


@functools.cache
def _masked_dirs() -> tuple[str, ...]:
    """The masked paths that are directories on this host's kernel: looked
    up once (twenty-odd stats a create otherwise; the kernel's /proc and
    /sys do not change shape while it runs)."""
    return tuple(p for p in profile.MASKED_PATHS if os.path.isdir(p))


def masks(empty_dir: Path | None) -> tuple[list[str], list[dict[str, Any]]]:
    """(maskedPaths for crun, bind mounts): with `empty_dir`, the masked
    directories this kernel has are bound read-only to it rather than left
    to crun, which mounts a tmpfs on each. A tmpfs is a superblock, and the
    kernel keeps, in every memory cgroup, a slot for every superblock on
    the host (its memcg-aware shrinkers): four per sandbox, times one
    cgroup per sandbox, is memory that grows with the square of the
    sandboxes held (docs/memory-reclaim.md). A bind of one host directory
    adds no superblock, and hides the directory's contents as well."""
    if empty_dir is None:
        return list(profile.MASKED_PATHS), []
    dirs = _masked_dirs()
    binds = [
        {
            "destination": d,
            "type": "bind",
            "source": str(empty_dir),
            "options": ["bind", "ro", "nosuid", "nodev", "noexec"],
        }
        for d in dirs
    ]
    return [p for p in profile.MASKED_PATHS if p not in dirs], binds


def cgroup_mounts(
    skeleton: Path | None, dirs: tuple[tuple[str, Path], ...]
) -> list[dict[str, Any]]:
    """The sandbox's /sys/fs/cgroup, read-only, showing its own cgroups as
    the roots (as crun's mounts in its cgroup namespace do). On cgroup v1
    crun puts a tmpfs there to hold each hierarchy's mount point: a
    superblock per sandbox (masks()). A bind of the platform's skeleton
    (Platform.cgroup_skeleton) and a bind of each of the sandbox's cgroup
    directories add none: a cgroup v1 hierarchy is one superblock however
    often it is mounted."""
    opts = ["nosuid", "noexec", "nodev"]
    if skeleton is None:
        return [
            {
                "destination": "/sys/fs/cgroup",
                "type": "cgroup",
                "source": "cgroup",
                "options": [*opts, "relatime", "ro"],
            }
        ]
    return [
        {
            "destination": "/sys/fs/cgroup",
            "type": "bind",
            "source": str(skeleton),
            "options": ["bind", "ro", *opts],
        },
        *(
            {
                "destination": f"/sys/fs/cgroup/{name}",
                "type": "bind",
                "source": str(path),
                "options": ["bind", "ro", *opts],
            }
            for name, path in dirs
        ),
    ]


def config(spec: BundleSpec) -> dict[str, Any]:
    masked, mask_binds = masks(spec.empty_dir)
    caps = list(profile.CAPABILITIES)
    nofile = _nofile_limit()
    memory: dict[str, Any] = {"limit": spec.memory}
    if spec.swap_accounting:
        memory["swap"] = spec.memory  # memory+swap == memory: no swap use
    if spec.swappiness is not None:
        memory["swappiness"] = spec.swappiness
    process_extra: dict[str, Any] = {}
    if CAN_PROTECT_INIT:
        # corral-init must survive the sandbox's own OOM; commands raise
        # their own score before exec, so they are what gets killed.
        process_extra["oomScoreAdj"] = -1000
    return {
        "ociVersion": "1.0.2",
        "hostname": "sandbox",
        "root": {"path": str(spec.rootfs), "readonly": spec.readonly_root},
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": [platform.INIT],
            "env": spec.env,
            "cwd": "/",
            "noNewPrivileges": True,
            "capabilities": {
                "bounding": caps,
                "effective": caps,
                "permitted": caps,
                "inheritable": [],
                "ambient": [],
            },
            "rlimits": [{"type": "RLIMIT_NOFILE", "soft": nofile, "hard": nofile}],
            **process_extra,
        },
        "mounts": [
            {
                "destination": "/proc",
                "type": "proc",
                "source": "proc",
                "options": ["nosuid", "noexec", "nodev"],
            },
            {
                "destination": "/dev",
                "type": "tmpfs",
                "source": "tmpfs",
                "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
            },
            {
                "destination": "/dev/pts",
                "type": "devpts",
                "source": "devpts",
                "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"],
            },
            {
                "destination": "/dev/mqueue",
                "type": "mqueue",
                "source": "mqueue",
                "options": ["nosuid", "noexec", "nodev"],
            },
            {
                "destination": "/sys",
                "type": "sysfs",
                "source": "sysfs",
                "options": ["nosuid", "noexec", "nodev", "ro"],
            },
            *cgroup_mounts(spec.cgroup_skeleton, spec.cgroup_dirs),
            *(
                {
                    "destination": dest,
                    "type": "tmpfs",
                    "source": "tmpfs",
                    "options": ["nosuid", "nodev", "mode=1777", f"size={size}", "nr_inodes=65536"],
                }
                for dest, size in spec.tmpfs
            ),
            {
                "destination": platform.MOUNT_POINT,
                "type": "bind",
                "source": str(spec.platform_dir),
                "options": ["rbind", "ro", "nosuid", "nodev"],
            },
            *mask_binds,
        ],
        "linux": {
            "namespaces": [
                {"type": "pid"},
                {"type": "network"},
                {"type": "ipc"},
                {"type": "uts"},
                {"type": "mount"},
                {"type": "cgroup"},
                *([{"type": "user"}] if spec.host_id is not None else []),
            ],
            **(
                {
                    "uidMappings": [{"containerID": 0, "hostID": spec.host_id, "size": IDS}],
                    "gidMappings": [{"containerID": 0, "hostID": spec.host_id, "size": IDS}],
                }
                if spec.host_id is not None
                else {}
            ),
            "cgroupsPath": spec.cgroups_path,
            "resources": {
                "memory": memory,
                "cpu": {
                    "shares": max(2, int(1024 * spec.cpu)),
                    "quota": int(spec.cpu * CPU_PERIOD),
                    "period": CPU_PERIOD,
                },
                "pids": {"limit": spec.pids},
                "devices": [{"allow": False, "access": "rwm"}],
                **({"blockIO": spec.io.oci()} if spec.io and spec.io.oci() else {}),
            },
            "maskedPaths": masked,
            "readonlyPaths": list(profile.READONLY_PATHS),
            **({"seccomp": spec.seccomp} if spec.seccomp else {}),
        },
    }
