"""The plan native/corral-run carries out: Corral's OCI config, translated.

corral-run is Corral's own runtime (oci_runtime = "corral"): it does for
the one shape of container Corral asks for what `crun run` does, without
crun's start, JSON and fork (docs/container-runtime.md). bundle.config()
stays the one description of a container; this module translates it and
refuses any field, option or value it has no translation for, so that
something added to the config one day cannot be dropped here in silence
(a mask or a limit that a crun sandbox has and a corral-run one lacks).

The plan is NUL-terminated tokens: a directive, then its arguments.
    root PATH                    readonly-root
    ns CLONE_FLAGS               idmap HOSTID SIZE        hostname NAME
    loopback                     cgroup DIR (joined; made by the agent)
    mount TYPE DEST MS_FLAGS DATA
    bind SRC DEST MOUNT_ATTRS RECURSIVE
    dev NAME   symlink TARGET PATH   dir PATH OCTAL_MODE
    mask PATH  readonly PATH
    rlimit RESOURCE SOFT HARD    caps MASK   oom SCORE
    seccomp BPF_FILE             listener SOCKET METADATA
    cwd PATH   env VALUE   arg VALUE   pidfile PATH
Mount and bind operations happen in the plan's order.
"""

from __future__ import annotations

import os
import re
import resource
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from corral.errors import InvalidArgument
from corral.host import devices

CLONE = {
    "mount": 0x00020000,
    "uts": 0x04000000,
    "ipc": 0x08000000,
    "user": 0x10000000,
    "pid": 0x20000000,
    "network": 0x40000000,
}
CLONE_NEWCGROUP = 0x02000000
# Every Corral container has these (the user namespace is a node setting);
# corral-run always makes the cgroup one.
REQUIRED_NS = {"pid", "network", "ipc", "uts", "mount", "cgroup"}

MS = {"ro": 0x1, "nosuid": 0x2, "nodev": 0x4, "noexec": 0x8, "relatime": 0x200000,
      "strictatime": 0x1000000}  # fmt: skip
MOUNT_ATTR = {"ro": 0x1, "nosuid": 0x2, "nodev": 0x4, "noexec": 0x8}
NEW_FS = {"proc", "tmpfs", "devpts", "mqueue", "sysfs"}

CAPS = {
    "CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_DAC_READ_SEARCH": 2, "CAP_FOWNER": 3,
    "CAP_FSETID": 4, "CAP_KILL": 5, "CAP_SETGID": 6, "CAP_SETUID": 7, "CAP_SETPCAP": 8,
    "CAP_LINUX_IMMUTABLE": 9, "CAP_NET_BIND_SERVICE": 10, "CAP_NET_BROADCAST": 11,
    "CAP_NET_ADMIN": 12, "CAP_NET_RAW": 13, "CAP_IPC_LOCK": 14, "CAP_IPC_OWNER": 15,
    "CAP_SYS_MODULE": 16, "CAP_SYS_RAWIO": 17, "CAP_SYS_CHROOT": 18, "CAP_SYS_PTRACE": 19,
    "CAP_SYS_PACCT": 20, "CAP_SYS_ADMIN": 21, "CAP_SYS_BOOT": 22, "CAP_SYS_NICE": 23,
    "CAP_SYS_RESOURCE": 24, "CAP_SYS_TIME": 25, "CAP_SYS_TTY_CONFIG": 26, "CAP_MKNOD": 27,
    "CAP_LEASE": 28, "CAP_AUDIT_WRITE": 29, "CAP_AUDIT_CONTROL": 30, "CAP_SETFCAP": 31,
    "CAP_MAC_OVERRIDE": 32, "CAP_MAC_ADMIN": 33, "CAP_SYSLOG": 34, "CAP_WAKE_ALARM": 35,
    "CAP_BLOCK_SUSPEND": 36, "CAP_AUDIT_READ": 37, "CAP_PERFMON": 38, "CAP_BPF": 39,
    "CAP_CHECKPOINT_RESTORE": 40,
}  # fmt: skip

RLIMITS = {"RLIMIT_NOFILE": resource.RLIMIT_NOFILE, "RLIMIT_NPROC": resource.RLIMIT_NPROC,
           "RLIMIT_CORE": resource.RLIMIT_CORE, "RLIMIT_STACK": resource.RLIMIT_STACK}  # fmt: skip

# What crun gives every container beyond its config (its defaults), kept
# so that a corral-run sandbox sees the same /dev.
DEVICES: tuple[str, ...] = devices.BOUND
DEV_LINKS = (
    ("/proc/self/fd", "/dev/fd"),
    ("/proc/self/fd/0", "/dev/stdin"),
    ("/proc/self/fd/1", "/dev/stdout"),
    ("/proc/self/fd/2", "/dev/stderr"),
    ("pts/ptmx", "/dev/ptmx"),
    ("/proc/kcore", "/dev/core"),
)
# The resources Cgroups.create writes (the agent makes the cgroups first).
RESOURCES = {
    "memory": {"limit", "swap", "swappiness"},
    "cpu": {"shares", "quota", "period"},
    "pids": {"limit"},
    "devices": None,  # deny-all only (checked below)
    "blockIO": None,  # IoLimit's, written by Cgroups.create from the same IoLimit
}


def _bad(
    where: str, value: Any, rule: str = "corral-run has no translation for it"
) -> InvalidArgument:
    return InvalidArgument(f"oci_runtime=corral: {where}", rule, value)


def _only(d: dict[str, Any], where: str, allowed: Iterable[str]) -> None:
    extra = sorted(set(d) - set(allowed))
    if extra:
        raise _bad(f"{where}.{extra[0]}", d[extra[0]])


def _mount_ops(m: dict[str, Any], cgroup_v2: bool) -> list[str]:
    _only(m, "mounts[]", ("destination", "type", "source", "options"))
    dest, kind, opts = m["destination"], m["type"], list(m.get("options", []))
    if not dest.startswith("/") or "\0" in dest:
        raise _bad("mounts[].destination", dest, "must be an absolute path")
    if kind == "bind":
        attrs, recursive = 0, 0
        for o in opts:
            if o == "bind":
                continue
            if o == "rbind":
                recursive = 1
            elif o in MOUNT_ATTR:
                attrs |= MOUNT_ATTR[o]
            else:
                raise _bad(f"mounts[{dest}].options", o)
        return ["bind", m["source"], dest, str(attrs), str(recursive)]
    if kind == "cgroup" and cgroup_v2:
        kind = "cgroup2"
    elif kind not in NEW_FS:
        raise _bad(f"mounts[{dest}].type", kind)
    flags, data = 0, []
    for o in opts:
        if o in MS:
            flags |= MS[o]
        elif "=" in o or o == "newinstance":
            data.append(o)
        else:
            raise _bad(f"mounts[{dest}].options", o)
    return ["mount", kind, dest, str(flags), ",".join(data)]


def plan(
    cfg: dict[str, Any],
    *,
    cgroup_dirs: Iterable[Path],
    pid_file: Path,
    bpf_file: Path | None,
    cgroup_v2: bool = False,
) -> bytes:
    """The plan for `cfg` (bundle.config()), whose cgroups are `cgroup_dirs`
    (made and limited by the agent), its compiled seccomp filter in
    `bpf_file`. Raises InvalidArgument naming what it cannot translate."""
    _only(cfg, "config", ("ociVersion", "hostname", "root", "process", "mounts", "linux",
                          "annotations"))  # fmt: skip
    _only(cfg.get("annotations", {}), "annotations", ("run.oci.seccomp_bpf_data",))
    t: list[str] = []
    root = cfg["root"]
    _only(root, "root", ("path", "readonly"))
    t += ["root", root["path"]]
    if root.get("readonly"):
        t.append("readonly-root")
    if "hostname" in cfg:
        t += ["hostname", cfg["hostname"]]

    lx = cfg["linux"]
    _only(lx, "linux", ("namespaces", "uidMappings", "gidMappings", "cgroupsPath", "resources",
                        "maskedPaths", "readonlyPaths", "seccomp"))  # fmt: skip
    kinds = []
    for ns in lx["namespaces"]:
        _only(ns, "linux.namespaces[]", ("type",))
        kinds.append(ns["type"])
    missing = sorted(REQUIRED_NS - set(kinds))
    if missing:
        raise _bad("linux.namespaces", kinds, f"must include {', '.join(missing)}")
    flags = 0
    for k in kinds:
        if k == "cgroup":
            continue
        if k not in CLONE:
            raise _bad("linux.namespaces[].type", k)
        flags |= CLONE[k]
    t += ["ns", str(flags)]
    if "network" in kinds:
        t.append("loopback")
    if "user" in kinds:
        maps = [lx.get("uidMappings", []), lx.get("gidMappings", [])]
        if any(len(m) != 1 for m in maps) or maps[0] != maps[1] or maps[0][0]["containerID"] != 0:
            raise _bad("linux.uidMappings", maps, "must be one range from 0, the same for gids")
        t += ["idmap", str(maps[0][0]["hostID"]), str(maps[0][0]["size"])]
    for d in cgroup_dirs:
        t += ["cgroup", str(d)]
    res = lx.get("resources", {})
    _only(res, "linux.resources", RESOURCES)
    for key, allowed in RESOURCES.items():
        if allowed is not None and key in res:
            _only(res[key], f"linux.resources.{key}", allowed)
    if res.get("devices", []) not in ([], [{"allow": False, "access": "rwm"}]):
        raise _bad("linux.resources.devices", res["devices"], "must deny all (crun's defaults)")

    for m in cfg.get("mounts", []):
        t += _mount_ops(m, cgroup_v2)
    for name in DEVICES:
        t += ["dev", name]
    for target, path in DEV_LINKS:
        t += ["symlink", target, path]
    t += ["dir", "/dev/shm", "1777"]
    for p in lx.get("maskedPaths", []):
        t += ["mask", p]
    for p in lx.get("readonlyPaths", []):
        t += ["readonly", p]

    proc = cfg["process"]
    _only(proc, "process", ("terminal", "user", "args", "env", "cwd", "noNewPrivileges",
                            "capabilities", "rlimits", "oomScoreAdj"))  # fmt: skip
    if proc.get("terminal"):
        raise _bad("process.terminal", True)
    if proc.get("user") != {"uid": 0, "gid": 0}:
        raise _bad("process.user", proc.get("user"), "must be uid 0, gid 0 (in the sandbox)")
    if proc.get("noNewPrivileges") is not True:
        raise _bad("process.noNewPrivileges", proc.get("noNewPrivileges"), "must be true")
    caps = proc.get("capabilities", {})
    _only(caps, "process.capabilities", ("bounding", "effective", "permitted", "inheritable",
                                         "ambient"))  # fmt: skip
    if caps.get("inheritable") or caps.get("ambient"):
        raise _bad("process.capabilities", caps, "inheritable and ambient must be empty")
    sets = {tuple(sorted(caps.get(k, []))) for k in ("bounding", "effective", "permitted")}
    if len(sets) != 1:
        raise _bad("process.capabilities", caps, "bounding, effective, permitted must be equal")
    mask = 0
    for name in caps.get("bounding", []):
        if name not in CAPS:
            raise _bad("process.capabilities", name, "unknown capability")
        mask |= 1 << CAPS[name]
    t += ["caps", hex(mask)]
    for r in proc.get("rlimits", []):
        if r["type"] not in RLIMITS:
            raise _bad("process.rlimits[].type", r["type"])
        t += ["rlimit", str(RLIMITS[r["type"]]), str(r["soft"]), str(r["hard"])]
    if "oomScoreAdj" in proc:
        t += ["oom", str(int(proc["oomScoreAdj"]))]

    sc = lx.get("seccomp")
    if sc is not None:
        if bpf_file is None or sc.get("syscalls"):
            raise _bad("linux.seccomp", "rules", "corral-run loads a compiled filter only")
        t += ["seccomp", str(bpf_file)]
        if sc.get("listenerPath"):
            meta = sc.get("listenerMetadata", "")
            if not re.fullmatch(r"[a-z0-9-]{1,128}", meta):  # a sandbox id, put into JSON as is
                raise _bad("linux.seccomp.listenerMetadata", meta, "must be a sandbox id")
            t += ["listener", sc["listenerPath"], meta]

    t += ["cwd", proc.get("cwd", "/")]
    for e in proc.get("env", []):
        t += ["env", e]
    for a in proc["args"]:
        t += ["arg", a]
    t += ["pidfile", str(pid_file)]
    for tok in t:
        if "\0" in tok:
            raise _bad("config", tok, "must not hold a NUL byte")
    return b"".join(os.fsencode(x) + b"\0" for x in t)
