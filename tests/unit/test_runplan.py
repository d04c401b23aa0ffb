"""runplan: Corral's OCI config as corral-run's plan, and what it refuses."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from corral.errors import InvalidArgument
from corral.guard import profile, seccomp
from corral.runtimes.container import bundle, runplan


def _config(**over: Any) -> dict[str, Any]:
    spec = dict(
        sandbox_id="n-1", rootfs=Path("/b/n-1/rootfs"), platform_dir=Path("/p"),
        env=["A=1", "B=x y"], cpu=0.5, memory=256 * 2**20, pids=64,
        cgroups_path="/corral/n/n-1", swap_accounting=True, host_id=1 << 20,
        empty_dir=Path("/p/empty"), swappiness=0, cgroup_skeleton=Path("/p/cgroup"),
        cgroup_dirs=(("memory", Path("/sys/fs/cgroup/memory/corral/n/n-1")),),
        seccomp=seccomp.profile("/run/seccomp.sock", "n-1", rules=False),
    )  # fmt: skip
    spec.update(over)
    return bundle.config(bundle.BundleSpec(**spec))  # type: ignore[arg-type]


def _plan(cfg: dict[str, Any]) -> list[list[str]]:
    raw = runplan.plan(cfg, cgroup_dirs=[Path("/sys/fs/cgroup/memory/corral/n/n-1")],
                       pid_file=Path("/b/n-1/init.pid"), bpf_file=Path("/run/f.bpf"))  # fmt: skip
    toks = raw.split(b"\0")
    assert toks[-1] == b""
    words = [t.decode() for t in toks[:-1]]
    arity = {"root": 1, "readonly-root": 0, "ns": 1, "idmap": 2, "hostname": 1, "loopback": 0,
             "cgroup": 1, "mount": 4, "bind": 4, "dev": 1, "symlink": 2, "dir": 2, "mask": 1,
             "readonly": 1, "rlimit": 3, "caps": 1, "oom": 1, "seccomp": 1, "listener": 2,
             "cwd": 1, "env": 1, "arg": 1, "pidfile": 1}  # fmt: skip
    out, i = [], 0
    while i < len(words):
        n = arity[words[i]]
        out.append(words[i : i + 1 + n])
        i += 1 + n
    return out


def test_a_container_config_becomes_a_plan() -> None:
    ops = _plan(_config())
    by = {o[0]: o for o in ops}
    assert by["root"] == ["root", "/b/n-1/rootfs"]
    # every namespace but cgroup's, which the child makes itself
    flags = int(by["ns"][1])
    assert flags == sum(runplan.CLONE.values())
    assert by["idmap"] == ["idmap", str(1 << 20), str(bundle.IDS)]
    assert ["loopback"] in ops and by["hostname"] == ["hostname", "sandbox"]
    assert by["cgroup"] == ["cgroup", "/sys/fs/cgroup/memory/corral/n/n-1"]
    assert ["mount", "proc", "/proc", "14", ""] in ops  # nosuid|nodev|noexec
    assert ["mount", "sysfs", "/sys", "15", ""] in ops  # ... and ro
    assert ["bind", "/p", "/.corral", "7", "1"] in ops  # ro|nosuid|nodev, rbind
    assert ["mask", "/proc/kcore"] in ops and ["readonly", "/proc/sys"] in ops
    # the user's env crosses whole, spaces and all
    assert ["env", "B=x y"] in ops
    assert by["caps"] == [
        "caps",
        hex(sum(1 << runplan.CAPS[c] for c in profile.CAPABILITIES)),
    ]
    assert by["seccomp"] == ["seccomp", "/run/f.bpf"]
    assert by["listener"] == ["listener", "/run/seccomp.sock", "n-1"]
    assert by["arg"] == ["arg", "/.corral/bin/corral-init"]
    # mounts before the masks that land on them: /proc first, its masks after
    kinds = [o[0] for o in ops]
    assert kinds.index("mount") < kinds.index("mask") < kinds.index("readonly")


def test_a_function_call_worker_has_a_read_only_root_and_its_tmpfs() -> None:
    ops = _plan(_config(readonly_root=True, tmpfs=(("/tmp", 64 * 2**20),)))
    assert ["readonly-root"] in ops
    assert ["mount", "tmpfs", "/tmp", "6", f"mode=1777,size={64 * 2**20},nr_inodes=65536"] in ops


def _set(path: str, value: Any) -> dict[str, Any]:
    cfg = copy.deepcopy(_config())
    node = cfg
    *parents, last = path.split(".")
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    node[last] = value
    return cfg


# What corral-run has no translation for is refused, named: a field added
# to the config one day cannot be dropped in silence.
BAD = [
    ("process.terminal", True, "process.terminal"),
    ("process.user", {"uid": 1000, "gid": 1000}, "process.user"),
    ("process.noNewPrivileges", False, "process.noNewPrivileges"),
    ("process.selinuxLabel", "x", "process.selinuxLabel"),
    ("process.capabilities.ambient", ["CAP_KILL"], "process.capabilities"),
    ("process.capabilities.effective", ["CAP_KILL"], "process.capabilities"),
    ("process.capabilities.bounding", ["CAP_NOPE"], "process.capabilities"),
    ("process.rlimits", [{"type": "RLIMIT_MEMLOCK", "soft": 1, "hard": 1}], "rlimits"),
    (
        "linux.namespaces",
        [{"type": t} for t in ("pid", "ipc", "uts", "mount", "cgroup", "network", "time")],
        "type",
    ),
    ("linux.namespaces", [{"type": "pid"}], "linux.namespaces"),
    (
        "linux.namespaces",
        [{"type": t} for t in ("pid", "ipc", "mount", "cgroup", "network")],
        "uts",
    ),
    ("linux.seccomp.listenerMetadata", 'x","pid":1', "listenerMetadata"),
    ("linux.sysctl", {"net.ipv4.ip_forward": "1"}, "linux.sysctl"),
    ("linux.resources.hugepageLimits", [], "linux.resources.hugepageLimits"),
    ("linux.resources.memory.kernel", 1, "linux.resources.memory.kernel"),
    ("linux.resources.devices", [{"allow": True, "access": "rwm"}], "linux.resources.devices"),
    ("linux.uidMappings", [{"containerID": 1, "hostID": 5, "size": 1}], "linux.uidMappings"),
    ("linux.seccomp.syscalls", [{"names": ["read"], "action": "SCMP_ACT_ALLOW"}], "seccomp"),
    ("mounts.0.options", ["nosuid", "shared"], "options"),
    ("mounts.0.type", "nfs", "type"),
    ("mounts.0.uidMappings", [], "mounts[].uidMappings"),
    ("mounts.0.destination", "proc", "destination"),
    ("hooks", {"prestart": []}, "config.hooks"),
    ("process.env", ["A=\0B"], "config"),
]


@pytest.mark.parametrize(
    ("path", "value", "named"), BAD, ids=[b[0] + ":" + str(b[1])[:20] for b in BAD]
)
def test_what_it_cannot_translate_is_refused_by_name(path: str, value: Any, named: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        _plan(_set(path, value))
    assert e.value.field.startswith("oci_runtime=corral")
    assert named in e.value.field or named in e.value.rule or named in str(e.value)


def test_rules_without_a_compiled_filter_are_refused() -> None:
    cfg = _config()
    with pytest.raises(InvalidArgument, match="compiled filter"):
        runplan.plan(cfg, cgroup_dirs=[], pid_file=Path("/x"), bpf_file=None)
