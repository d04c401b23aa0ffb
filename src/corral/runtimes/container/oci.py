"""Drive crun (or runc, or Corral's own corral-run) through corral-nsexec.

Every invocation runs in a fresh private mount namespace (see
native/corral-nsexec.c): the sandbox's overlay is mounted there, so only the
container's own namespace ever holds it, and on hybrid cgroup hosts the
cgroup2 mount crun chokes on is hidden there.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from corral.errors import SandboxFailed
from corral.host import sealed, spawn
from corral.log import get_logger

log = get_logger("corral.oci")

# The runtime returns once the container's init runs (~10 ms here, seconds
# on a loaded TCG guest); one still going after this is stuck, and its
# create fails (and is released) rather than holding its caller.
START_TIMEOUT = 120.0


@dataclass(frozen=True)
class Overlay:
    lower: list[Path]  # topmost first
    upper: Path
    work: Path
    target: Path


class OciRuntime:
    def __init__(
        self,
        binary: str,
        state_root: Path,
        bundle_root: Path,
        nsexec: Path,
        hybrid: bool,
        unified: Path | None = None,
    ) -> None:
        self.binary = binary
        self.state_root = state_root
        # Each container's bundle: rootfs/ (a mount point), stage/, init.pid,
        # logs, layout.json (config.json until crun has started it). Beside the runtime's state, on
        # the node's run tmpfs (host/runfs.py); what a container keeps on disk
        # (a checkpoint, saved state) goes to its sandbox dir.
        self.bundle_root = bundle_root
        bundle_root.mkdir(mode=0o711, parents=True, exist_ok=True)
        self.nsexec = nsexec
        self.hybrid = hybrid
        self.unified = unified  # Cgroups.unified
        state_root.mkdir(parents=True, exist_ok=True)
        # corral-run (runplan.py): Corral's own runtime, run from a plan.
        # It never enters a running sandbox (its child execs the init
        # before the sandbox runs anything), so it needs no sealed copy.
        self.own = Path(binary).name == "corral-run"
        # None: the kernel will not run a memfd; crun copies itself per call.
        self.exec_fd = None if self.own else sealed.sealed_copy(binary)

    def close(self) -> None:
        if self.exec_fd is not None:
            os.close(self.exec_fd)
            self.exec_fd = None

    def _fds(self, *more: int) -> list[int]:
        return [*more, *([self.exec_fd] if self.exec_fd is not None else [])]

    @staticmethod
    def _env() -> dict[str, str]:
        # corral-nsexec checks its parent is still this agent (see its comment).
        return {**os.environ, "CORRAL_AGENT_PID": str(os.getpid())}

    def _base(self) -> list[str]:
        cmd = [str(self.nsexec)]
        if self.hybrid:
            cmd.append("--hybrid")
            if self.unified is not None:
                cmd += ["--unified", str(self.unified)]
        if self.exec_fd is not None:
            cmd += ["--exec-fd", str(self.exec_fd)]
        return cmd

    def _runtime(self, log_file: Path | None = None) -> list[str]:
        cmd = [self.binary, "--root", str(self.state_root)]
        if log_file:
            cmd += ["--log", str(log_file), "--log-format", "json"]
        if self.binary.endswith("crun"):
            cmd.append("--cgroup-manager=cgroupfs")
        return cmd

    async def run(
        self,
        container_id: str,
        bundle: Path,
        *,
        overlay: Overlay,
        listen_fd: int,
        pid_file: Path,
        log_file: Path,
        idmap: tuple[int, int] | None = None,
        stage: Path | None = None,
        ns_limits: dict[str, int] | None = None,
        plan: Path | None = None,
    ) -> None:
        """Mount the root and start the container detached; fd listen_fd
        becomes fd 3 of its init. With ns_limits, the per-user-namespace
        kernel counters of its namespace are set once it has started
        (corral-nsexec --limits-of says why). corral-run takes its `plan`
        (runplan.py) instead of the bundle's config.json."""
        cmd = self._base()
        cmd += [
            "--overlay",
            ":".join(str(p) for p in overlay.lower),
            str(overlay.upper),
            str(overlay.work),
            str(overlay.target),
            *(
                ["--idmap", f"{idmap[0]}:{idmap[1]}", "--stage", str(stage)]
                if idmap and stage
                else []
            ),
            "--listen-fd",
            str(listen_fd),
            "--log",
            str(log_file.with_suffix(".out")),
            *(["--limits-of", str(pid_file)] if ns_limits else []),
            *(a for k, v in sorted((ns_limits or {}).items()) for a in ("--limit", f"{k}={v}")),
            "--",
        ]
        if self.own:
            assert plan is not None
            cmd += [self.binary, str(plan)]
        else:
            cmd += [*self._runtime(log_file), "run", "--detach", "--bundle", str(bundle),
                    "--pid-file", str(pid_file), "--preserve-fds", "1", container_id]  # fmt: skip
        try:
            done = await spawn.run(
                cmd, pass_fds=self._fds(listen_fd), env=self._env(), timeout=START_TIMEOUT
            )
        except TimeoutError:
            raise SandboxFailed(
                f"starting container {container_id} with {self.binary} ran past "
                f"{START_TIMEOUT:g} s; killed",
                sandbox=container_id,
            ) from None
        if done.code != 0:
            # corral-run's stderr is the init's: nsexec's --log file.
            detail = done.stderr.decode(errors="replace").strip() or (
                _last_line(log_file.with_suffix(".out")) if self.own else _last_error(log_file)
            )
            raise SandboxFailed(
                f"starting container {container_id} with {self.binary} failed "
                f"(exit {done.code}): {detail}",
                sandbox=container_id,
            )

    def forget(self, container_id: str) -> None:
        """Remove the runtime's state of a container whose processes are
        gone (runtime.py's _Deleter says why not `crun delete`)."""
        shutil.rmtree(self.state_root / container_id, ignore_errors=True)

    def bundle(self, container_id: str) -> Path:
        return self.bundle_root / container_id

    def bundles(self) -> set[str]:
        """Paths of the bundles on the host."""
        try:
            return {str(p) for p in self.bundle_root.iterdir()}
        except OSError:
            return set()

    def known(self) -> set[str]:
        """Container ids the runtime keeps state for (crun/runc state dirs)."""
        try:
            return {p.name for p in self.state_root.iterdir() if p.is_dir()}
        except OSError:
            return set()


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return lines[-1] if lines else "(empty log)"


def _last_error(log_file: Path) -> str:
    try:
        lines = log_file.read_text().strip().splitlines()
    except OSError:
        return "(no log)"
    for line in reversed(lines):
        try:
            return str(json.loads(line).get("msg", line))
        except ValueError:
            return line
    return "(empty log)"
