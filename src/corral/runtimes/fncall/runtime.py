"""Function-call workers: container sandboxes whose root is read-only and
whose only writable places are small tmpfs mounts, so that a reset (kill
everything, empty those mounts) returns a worker to a clean state."""

from __future__ import annotations

from pathlib import Path

from corral.host.cgroups import Cgroups
from corral.host.platform import Platform
from corral.runtimes.container.oci import OciRuntime
from corral.runtimes.container.runtime import ContainerRuntime


class FnCallRuntime(ContainerRuntime):
    kind = "fncall"
    readonly_root = True
    # A stateless worker has nothing to keep: it is never suspended.
    suspend_modes: tuple[str, ...] = ()

    def __init__(
        self,
        oci: OciRuntime,
        cgroups: Cgroups,
        platform: Platform,
        seccomp_listener: Path | None,
        tmpfs_size: int,
        ns_limits: dict[str, int] | None = None,
    ) -> None:
        # No I/O ceiling: a worker writes only to its tmpfs mounts.
        super().__init__(oci, cgroups, platform, seccomp_listener, ns_limits=ns_limits)
        # /mnt: SandboxFusion's calls write there too (its runner is root).
        self.tmpfs = (("/tmp", tmpfs_size), ("/work", tmpfs_size), ("/mnt", tmpfs_size))
