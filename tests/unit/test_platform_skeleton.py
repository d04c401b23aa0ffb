"""The platform's cgroup skeleton: one read-only directory per hierarchy."""

from __future__ import annotations

import os
from pathlib import Path

from corral.host.platform import Platform


def test_the_skeleton_has_each_hierarchy_and_the_hosts_links_to_them(tmp_path: Path) -> None:
    host = tmp_path / "host"
    for name in ("cpu,cpuacct", "memory", "pids"):
        (host / name).mkdir(parents=True)
    os.symlink("cpu,cpuacct", host / "cpu")
    os.symlink("elsewhere", host / "stray")  # not a hierarchy: not copied
    layer = tmp_path / "layer"
    layer.mkdir()
    p = Platform(layer_dir=layer, nsexec=layer, seccompd=layer, relisten=layer, netmove=layer,
                 run=layer,
                 empty_dir=layer / "empty")  # fmt: skip
    hs = [host / "cpu,cpuacct", host / "memory", host / "pids"]
    root = p.cgroup_skeleton(hs)
    assert root == layer / "cgroup"
    assert sorted(os.listdir(root)) == ["cpu", "cpu,cpuacct", "memory", "pids"]
    assert os.readlink(root / "cpu") == "cpu,cpuacct"
    assert all(not any((root / n).iterdir()) for n in ("memory", "pids"))
    assert (root.stat().st_mode & 0o777) == 0o555
    assert p.cgroup_skeleton(hs) == root  # again: idempotent
