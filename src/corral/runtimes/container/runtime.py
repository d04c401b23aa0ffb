"""Container sandboxes: an OCI bundle run by crun, corral-init as PID 1."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
from pathlib import Path
from typing import Any

from corral.errors import SandboxFailed
from corral.guard import seccomp
from corral.node.cgroups import Cgroups, Mode
from corral.node.platform import Platform
from corral.node.store import SandboxRecord
from corral.runtimes.base import Prepared, Started, process_start_time
from corral.runtimes.container import bundle
from corral.runtimes.container.oci import OciRuntime, Overlay


class ContainerRuntime:
    kind = "container"
    readonly_root = False
    tmpfs: tuple[tuple[str, int], ...] = ()

    def __init__(
        self, oci: OciRuntime, cgroups: Cgroups, platform: Platform, seccomp_listener: Path | None
    ) -> None:
        self.oci = oci
        self.cgroups = cgroups
        self.platform = platform
        self.seccomp_listener = seccomp_listener
        self.swap_accounting = cgroups.mode is Mode.V2 or any(
            (h / "memory.memsw.limit_in_bytes").exists() for h in cgroups.hierarchies
        )
        # Compiled seccomp filters by profile: compiling the allow-list with
        # libseccomp costs crun ~20 ms a create (its own cache is not used
        # here), so the BPF crun wrote for the first sandbox is handed to
        # the next ones ready-made (run.oci.seccomp_bpf_data).
        self._bpf: dict[str, str] = {}

    @staticmethod
    def _filter_key(profile: dict[str, Any]) -> str:
        # The listener fields choose where notifications go, not the filter.
        rules = {k: v for k, v in profile.items() if not k.startswith("listener")}
        return hashlib.sha256(json.dumps(rules, sort_keys=True).encode()).hexdigest()

    def resources(self, sandbox_id: str, prep: Prepared) -> list[tuple[str, str]]:
        return [("socket", str(prep.control)), ("container", sandbox_id), ("cgroup", sandbox_id)]

    async def start(self, rec: SandboxRecord, prep: Prepared) -> Started:
        rootfs = prep.sandbox_dir / "rootfs"
        rootfs.mkdir(exist_ok=True)
        spec = rec.spec
        profile = (
            seccomp.profile(str(self.seccomp_listener), rec.id) if self.seccomp_listener else None
        )
        key = self._filter_key(profile) if profile else ""
        cfg = bundle.config(
            bundle.BundleSpec(
                sandbox_id=rec.id,
                rootfs=rootfs,
                platform_dir=self.platform.layer_dir,
                env=prep.env,
                cpu=spec["cpu"],
                memory=spec["memory"],
                pids=spec["pids"],
                cgroups_path=self.cgroups.oci_path(rec.id),
                swap_accounting=self.swap_accounting,
                seccomp=profile,
                host_id=prep.host_id,
                readonly_root=self.readonly_root,
                tmpfs=self.tmpfs,
            )
        )
        if key in self._bpf:
            cfg["annotations"] = {"run.oci.seccomp_bpf_data": self._bpf[key]}
        (prep.sandbox_dir / "config.json").write_text(json.dumps(cfg))

        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if prep.control.exists():
                prep.control.unlink()
            listener.bind(str(prep.control))
            os.chmod(prep.control, 0o600)
            listener.listen(512)
            pid_file = prep.sandbox_dir / "init.pid"
            await self.oci.run(
                rec.id,
                prep.sandbox_dir,
                overlay=Overlay(prep.lower, prep.upper, prep.work, rootfs),
                idmap=(prep.host_id, bundle.IDS) if prep.host_id is not None else None,
                stage=prep.sandbox_dir / "stage",
                listen_fd=listener.fileno(),
                pid_file=pid_file,
                log_file=prep.sandbox_dir / "oci.log",
            )
        finally:
            # The container's init holds its own copy of the listening socket.
            listener.close()
        if key and key not in self._bpf:
            compiled = self.oci.state_root / rec.id / "seccomp.bpf"
            if compiled.exists():
                self._bpf[key] = base64.b64encode(compiled.read_bytes()).decode()
        pid = int(pid_file.read_text().strip())
        started = process_start_time(pid)
        if started is None:
            raise SandboxFailed(
                f"sandbox {rec.id}: its init (pid {pid}) exited right after start; "
                f"see {prep.sandbox_dir / 'oci.out'}",
                sandbox=rec.id,
            )
        return Started(pid=pid, pid_start=started)

    async def release(self, kind: str, ref: str) -> bool:
        if kind == "container":
            await self.oci.delete(ref)
        elif kind == "cgroup":
            self.cgroups.remove(ref)
        else:
            return False
        return True

    def leftovers(self) -> set[str]:
        """Sandbox ids with container state or cgroups on this node."""
        return self.oci.known() | self.cgroups.present()


def control_path(run_dir: Path, sandbox_id: str) -> Path:
    return run_dir / f"{sandbox_id}.sock"
