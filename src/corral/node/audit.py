"""What each sandbox did and was refused: its command log on the host and
its audit counters (node/store.py `audit` table), kept after it closes.

Command output is never logged, only what ran and how it ended; the log is
capped per sandbox (log_quota), so an agent printing forever fills nothing.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from corral.api.models import AuditReport, ExecExit, ExecRequest, LogLine, Usage
from corral.api.verdict import DEFAULT_RULES
from corral.config import NodeConfig
from corral.guard.dns import DENIED_NAME
from corral.guard.network import NodeNetwork
from corral.guard.seccompd import SeccompDaemon, syscall_class
from corral.host.cgroups import Cgroups
from corral.host.scratch import Scratch
from corral.node.events import EventBus
from corral.node.misbehaviour import Key, Misbehaviour, command_text, totals
from corral.node.store import SandboxRecord, Store

# An audit counter of a closed sandbox's denied syscalls, by seccompd slot.
SYSCALL_SLOT = "syscall:"


class Audit:
    def __init__(
        self,
        config: NodeConfig,
        store: Store,
        cgroups: Cgroups,
        seccompd: SeccompDaemon,
        network: NodeNetwork,
        scratch: Scratch,
        pending: Callable[[str], dict[str, int]],
        misbehaviour: Misbehaviour,
        events: EventBus,
        running: Callable[[str], int],
    ) -> None:
        self.config = config
        self.store = store
        self.cgroups = cgroups
        self.seccompd = seccompd
        self.network = network
        self.scratch = scratch
        self._pending = pending  # counts not yet in the store (the DNS resolver's)
        self.misbehaviour = misbehaviour
        self.events = events
        self._running = running  # commands running in a sandbox now

    def begin(self, sandbox_id: str) -> None:
        """A command starts (its findings are what the counters gain from here)."""
        if not self.misbehaviour.tracking(sandbox_id):
            self.misbehaviour.begin(sandbox_id, self._per_command(sandbox_id))

    def _per_command(self, sandbox_id: str) -> dict[Key, int]:
        # The cheap counters only, read twice a command: the kernel's (OOM
        # kills, pids limit, nft) are read for a report, not per command.
        return totals(self._counted(sandbox_id, False, net=False))

    def account(
        self,
        sandbox_id: str,
        argv: builtins.list[str],
        req: ExecRequest,
        outcome: str,
        x: ExecExit | None,
        t0: float,
    ) -> None:
        """Count a command and append it to the sandbox's command log."""
        db = self.store
        # A command's stream may end after the agent closed its store.
        if db.closed or db.get(sandbox_id) is None:
            return
        db.count(sandbox_id, "commands")
        entry: dict[str, Any] = {
            "ts": time.time(),
            "argv": [a[:512] for a in argv[-3:]],
            "user": req.user,
            "outcome": outcome,
        }
        if x is not None:
            dropped = max(0, x.stdout_bytes - req.stdout_limit) + max(
                0, x.stderr_bytes - req.stderr_limit
            )
            if x.timed_out:
                db.count(sandbox_id, "commands_timed_out")
            if dropped:
                db.count(sandbox_id, "output_truncated")
                db.count(sandbox_id, "output_dropped_bytes", dropped)
            entry.update(
                exit_code=x.exit_code,
                signal=x.signal,
                stdout_bytes=x.stdout_bytes,
                stderr_bytes=x.stderr_bytes,
                seconds=round(x.duration, 3),
            )
        else:
            entry["seconds"] = round(time.monotonic() - t0, 3)
        self._log_command(sandbox_id, entry)
        self.misbehaviour.ended(sandbox_id, argv, self._per_command(sandbox_id), entry["ts"])
        if self.events.active:
            self.events.publish(
                "command", sandbox_id, command=command_text(argv),
                exit_code=None if x is None else x.exit_code, seconds=entry["seconds"],
            )  # fmt: skip

    def log_state(self, sandbox_id: str, state: str) -> None:
        """A state change in the command log: the sandbox's timeline."""
        if (self.config.sandboxes_dir / sandbox_id).is_dir():
            self._log_command(sandbox_id, {"ts": time.time(), "event": "state", "state": state})

    def _log_command(self, sandbox_id: str, entry: dict[str, Any]) -> None:
        """Append to the sandbox's command log on the host, within its quota."""
        path = self.config.sandboxes_dir / sandbox_id / "commands.log"
        line = (json.dumps(entry, default=str)[:4096] + "\n").encode()
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            size = 0
        db = self.store
        if size + len(line) > self.config.log_quota:
            if not db.counters(sandbox_id).get("log_quota_hits"):
                marker = json.dumps({"event": "log quota reached", "quota": self.config.log_quota})
                _append(path, marker.encode() + b"\n")
            db.count(sandbox_id, "log_quota_hits")
            return
        _append(path, line)

    def keep_kernel_counters(self, sandbox_id: str) -> None:
        """Keep the kernel's counters before the cgroup goes away."""
        for key, value in (
            ("oom_kills", self.cgroups.oom_kills(sandbox_id)),
            ("pids_limit_hits", self.cgroups.pids_limit_hits(sandbox_id)),
        ):
            if value:
                self.store.count(sandbox_id, key, value)

    def keep_seccomp_counts(self, sandbox_id: str) -> None:
        """Fold the seccomp daemon's counts of a sandbox whose processes are
        gone into its audit counters, and remove the daemon's file (else one
        stays per sandbox ever made: they went with nothing before)."""
        counts = self.seccompd.counts(sandbox_id)
        if counts and self.store.get(sandbox_id) is not None:  # a purged one keeps nothing
            with self.store.transaction():
                for slot, n in counts.items():
                    self.store.count(sandbox_id, f"{SYSCALL_SLOT}{slot}", n)
        self.seccompd.forget(sandbox_id)

    def _counted(self, sandbox_id: str, running: bool, net: bool) -> AuditReport:
        """The counters: the store's, the resolver's not yet flushed, the
        seccomp daemon's, the kernel's (while the cgroup lives) and, with
        `net`, the nft counters (a subprocess: not per command)."""
        counters = self.store.counters(sandbox_id)
        for key, value in self._pending(sandbox_id).items():
            counters[key] = counters.get(key, 0) + value
        report = AuditReport(sandbox=sandbox_id)
        syscalls: dict[int, int] = {}  # by seccompd slot: kept at close, then the daemon's
        for key, value in counters.items():
            if key in AuditReport.model_fields:
                setattr(report, key, value)
            elif key.startswith(DENIED_NAME):
                report.dns_denied_names[key[len(DENIED_NAME) :]] = value
            elif key.startswith(SYSCALL_SLOT):
                syscalls[int(key[len(SYSCALL_SLOT) :])] = value
        if running:
            report.oom_kills += self.cgroups.oom_kills(sandbox_id)
            report.pids_limit_hits += self.cgroups.pids_limit_hits(sandbox_id)
        for slot, n in self.seccompd.counts(sandbox_id).items():
            syscalls[slot] = syscalls.get(slot, 0) + n
        for slot, n in syscalls.items():
            cls, name = syscall_class(slot)
            report.syscalls_denied[cls] = report.syscalls_denied.get(cls, 0) + n
            report.syscalls[name] = report.syscalls.get(name, 0) + n
        row = self.store.net_get(sandbox_id) if net else None
        if row is not None:
            report.egress_denied += self.network.denied(row[0])
            report.dns_flooded += self.network.dns_flooded(row[0])
        return report

    async def report(self, rec: SandboxRecord) -> AuditReport:
        sandbox_id = rec.id
        # Closing, the nft counters are (being) kept in the store: not read twice.
        live_net = rec.state not in ("closing", "closed", "failed")
        report = self._counted(sandbox_id, rec.state == "running", net=live_net)
        if rec.state == "running":
            usage = await asyncio.to_thread(self.scratch.usage, sandbox_id)
            if usage is not None:
                report.disk_used, report.disk_limit = usage
        log_path = self.config.sandboxes_dir / sandbox_id / "commands.log"
        report.log_bytes = log_path.stat().st_size if log_path.exists() else 0
        busy = self._running(sandbox_id) > 0
        report.findings = await self.misbehaviour.findings(rec, report, busy)
        report.verdict = DEFAULT_RULES.verdict(report.findings)
        return report

    async def at_close(self, rec: SandboxRecord) -> None:
        """Before its resources go: what only the living sandbox shows (its
        file system, its processes, the kernel's nft counters)."""
        if rec.state not in ("closing", "creating"):
            return
        row = self.store.net_get(rec.id)
        # Once: a close that recovery finishes comes here again.
        if row is not None and not self.store.counters(rec.id).get("net_kept"):
            self.store.count(rec.id, "net_kept")
            for key, value in (
                ("egress_denied", self.network.denied(row[0])),
                ("dns_flooded", self.network.dns_flooded(row[0])),
            ):
                if value:
                    self.store.count(rec.id, key, value)
        await self.misbehaviour.at_close(rec, self._running(rec.id) > 0)

    async def usage(self, rec: SandboxRecord) -> Usage:
        """Read now from the sandbox's cgroup and writable layer."""
        spec = rec.spec
        out = Usage(
            sandbox=rec.id, at=time.time(), cpu=float(spec.get("cpu", 0)),
            cpu_seconds=0.0, memory_used=0, memory_limit=int(spec.get("memory", 0)),
        )  # fmt: skip
        if rec.state in ("running", "suspended", "suspending"):
            out.cpu_seconds = self.cgroups.cpu_seconds(rec.id) or 0.0
            out.memory_used = self.cgroups.memory_usage(rec.id) or 0
            out.pids = self.cgroups.pids(rec.id) or 0
            disk = await asyncio.to_thread(self.scratch.usage, rec.id)
            if disk is not None:
                out.disk_used, out.disk_limit = disk
        return out

    def command_log(self, sandbox_id: str, start: float, limit: int) -> list[LogLine]:
        path = self.config.sandboxes_dir / sandbox_id / "commands.log"
        try:
            raw = path.read_text(errors="replace")
        except FileNotFoundError:
            return []
        out: list[LogLine] = []
        ts = 0.0
        for text in raw.splitlines():
            try:
                ts = float(json.loads(text).get("ts", ts))
            except (ValueError, AttributeError):
                pass  # a line cut at 4 KiB, or the quota marker: the time before it
            if ts >= start:
                out.append(LogLine(ts=ts, line=text))
                if len(out) >= limit:
                    break
        return out


def _append(path: Path, data: bytes) -> None:
    """Append, creating the file root-only (what ran is nobody else's)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
