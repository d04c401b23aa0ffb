"""A sandbox's misbehaviour report: the audit's counters turned into
findings, each tied to the command that caused it where one can be named,
plus what its file system and process table show (docs/report.md).

Counted findings (refused syscalls, DNS names, output past its cap...)
are taken when a command ends: what the counters gained since the last
command ended is that command's, recorded at once and sent on the event
stream. What they gained with no command ending since (a background
process, the kernel's nft counters read only for a report) shows in the
report as findings with no command, the totals minus what was recorded.
So every count is in the report exactly once, after an agent restart too.

File system findings (node/fschanges.py) and processes left running are
read when a report is asked for, and recorded once at close (the upper
directory and the cgroup go with the sandbox).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from corral.api.models import AuditReport, Finding
from corral.api.verdict import DEFAULT_RULES
from corral.config import NodeConfig
from corral.host.cgroups import Cgroups
from corral.host.scratch import Scratch
from corral.node import findlog, fschanges
from corral.node.events import EventBus
from corral.node.store import SandboxRecord, Store

Key = tuple[str, str]  # (finding kind, detail): one counter
LINGER = 0.2  # seconds a process must outlive the last command to be "left"


def totals(report: AuditReport) -> dict[Key, int]:
    """The report's counters as finding kinds (a counter at 0 is left out)."""
    out: dict[Key, int] = {}
    for cls, n in report.syscalls_denied.items():
        out[("syscall_denied", cls)] = n
    for name, n in report.dns_denied_names.items():
        out[("dns_denied", name)] = n
    for key, value in (
        (("egress_denied", "egress"), report.egress_denied),
        (("dns_flood", "dns"), report.dns_flooded),
        (("dns_rebinding", "dns"), report.dns_rebinding),
        (("forged_reply", "exec server"), report.replies_refused),
        (("output_flood", "output"), report.output_truncated),
        (("output_flood", "console bytes"), report.console_dropped_bytes),
        (("output_flood", "command log"), report.log_quota_hits),
        (("oom_kill", "memory"), report.oom_kills),
        (("pids_limit", "pids"), report.pids_limit_hits),
        (("command_timeout", "timeout"), report.commands_timed_out),
    ):
        if value:
            out[key] = value
    return out


def _finding(sandbox_id: str, key: Key, n: int, command: str | None, at: float) -> Finding:
    kind, detail = key
    sev = DEFAULT_RULES.severity_of(kind, detail)
    return Finding(
        sandbox=sandbox_id, kind=kind, severity=sev, at=at, command=command, detail=detail, count=n
    )


def command_text(argv: list[str]) -> str:
    # A command string runs as [shell, "-c", text]: the text says what ran.
    return (argv[-1] if len(argv) >= 3 and argv[-2] == "-c" else " ".join(argv))[:512]


class Misbehaviour:
    def __init__(
        self,
        config: NodeConfig,
        store: Store,
        cgroups: Cgroups,
        scratch: Scratch,
        events: EventBus,
        lower_of: Callable[[SandboxRecord], list[Path]],
    ) -> None:
        self.config = config
        self.store = store
        self.cgroups = cgroups
        self.scratch = scratch
        self.events = events
        self._lower_of = lower_of
        self._seen: dict[str, dict[Key, int]] = {}  # the counters at the last command's end

    # ---------------------------------------------------------------- counted

    def tracking(self, sandbox_id: str) -> bool:
        return sandbox_id in self._seen

    def begin(self, sandbox_id: str, now: dict[Key, int]) -> None:
        """A command starts: counts from here on are its (or a later one's)."""
        self._seen.setdefault(sandbox_id, now)

    def ended(
        self, sandbox_id: str, argv: list[str], now: dict[Key, int], at: float
    ) -> list[Finding]:
        """A command ended: record what the counters gained as its findings."""
        before = self._seen.get(sandbox_id, {})
        self._seen[sandbox_id] = now
        command = command_text(argv)
        found = [
            _finding(sandbox_id, key, n - before.get(key, 0), command, at)
            for key, n in now.items()
            if n > before.get(key, 0)
        ]
        self.record(sandbox_id, found)
        return found

    def forget(self, sandbox_id: str) -> None:
        self._seen.pop(sandbox_id, None)

    def record(self, sandbox_id: str, found: list[Finding]) -> None:
        """Keep findings in the store, the command log and the stream."""
        if not found:
            return
        findlog.add(self.store.db, sandbox_id, found)
        for f in found:
            line = {"ts": f.at, "event": "finding", "finding": f.model_dump(exclude={"sandbox"})}
            self._log(sandbox_id, line)
            self.events.publish("finding", sandbox_id, finding=f)

    def _log(self, sandbox_id: str, entry: dict[str, object]) -> None:
        """A line in the command log (the timeline), within its quota: past
        it the store still holds the finding, and the log grows no more."""
        path = self.config.sandboxes_dir / sandbox_id / "commands.log"
        line = (json.dumps(entry, default=str)[:4096] + "\n").encode()
        try:
            if path.stat().st_size + len(line) > self.config.log_quota:
                return
            fd = os.open(path, os.O_WRONLY | os.O_APPEND, 0o600)
        except OSError:
            return  # closed (the store holds it), or no command logged yet
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    # ---------------------------------------------------------------- the report

    async def findings(self, rec: SandboxRecord, report: AuditReport, busy: bool) -> list[Finding]:
        """Recorded findings, the counts no command took, and (while the
        sandbox runs) what its file system and processes show. The store is
        read on the event loop's thread (its one connection), the file
        system in a worker thread."""
        recorded = findlog.of(self.store.db, rec.id)
        taken: dict[Key, int] = {}
        for f in recorded:
            key = (f.kind, f.detail)
            taken[key] = taken.get(key, 0) + f.count
        now = time.time()
        out = list(recorded)
        for key, n in totals(report).items():
            if n > taken.get(key, 0):
                out.append(_finding(rec.id, key, n - taken.get(key, 0), None, now))
        if rec.state == "running":
            out += await self.live(rec, busy)
        if report.disk_limit and report.disk_used and report.disk_used >= report.disk_limit * 0.98:
            out.append(_finding(rec.id, ("disk_full", "disk"), 1, None, now))
        return sorted(out, key=lambda f: f.at)

    async def live(self, rec: SandboxRecord, busy: bool) -> list[Finding]:
        """What the file system and the process table show now (a container's)."""
        if rec.kind != "container":
            return []
        upper = self.scratch.path(rec.id) / "upper"
        protected = list(rec.spec.get("protected") or [])
        baseline = findlog.baseline(self.store.db, rec.id)
        lower = self._lower_of(rec)
        changes, commands, left = await asyncio.to_thread(
            lambda: (
                fschanges.changes(upper, lower, protected, baseline),
                self._commands(rec.id),
                self.processes_left(rec) if not busy else [],
            )
        )
        out = [
            Finding(
                sandbox=rec.id,
                kind=c.kind,
                severity=DEFAULT_RULES.severity_of(c.kind),
                at=c.mtime,
                command=_at(commands, c.mtime),
                detail=c.detail,
            )
            for c in changes
        ]
        if left:
            out.append(_finding(rec.id, ("processes_left", ", ".join(left)[:200]), len(left),
                                None, time.time()))  # fmt: skip
        return out

    def processes_left(self, rec: SandboxRecord) -> list[str]:
        """Processes of the sandbox but its init (which is also its exec
        server), read when no command runs: what the agent left behind.
        Those still there a moment later and not zombies: a command's own
        process may still be on its way out when its exit is reported."""
        first = set(self.cgroups.procs(rec.id)) - {rec.init_pid}
        if not first:
            return []
        time.sleep(LINGER)
        names: list[str] = []
        for pid in sorted(first & set(self.cgroups.procs(rec.id))):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue  # gone meanwhile
            comm, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2]
            if state != "Z":
                names.append(f"{comm}[{pid}]")
        return names

    async def protect(self, rec: SandboxRecord, paths: list[str]) -> None:
        """Protect more paths from now on (their upper entries now: the baseline)."""
        if rec.kind != "container":
            return
        upper = self.scratch.path(rec.id) / "upper"
        now = await asyncio.to_thread(fschanges.signatures, upper, paths)
        findlog.set_baseline(self.store.db, rec.id, dict(now))

    async def at_close(self, rec: SandboxRecord, busy: bool) -> None:
        """Record what only the living sandbox shows (its upper directory and
        cgroup go with it). `busy`: a command still runs (killed with it)."""
        self.record(rec.id, await self.live(rec, busy))
        self.forget(rec.id)

    def _commands(self, sandbox_id: str) -> list[tuple[float, float, str]]:
        """(start, end, text) of the sandbox's logged commands."""
        path = self.config.sandboxes_dir / sandbox_id / "commands.log"
        out: list[tuple[float, float, str]] = []
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            return out
        for text in lines:
            try:
                e = json.loads(text)
                end = float(e["ts"])
                out.append((end - float(e.get("seconds", 0)), end, command_text(e["argv"])))
            except (ValueError, KeyError, TypeError):
                continue
        return out


def _at(commands: list[tuple[float, float, str]], when: float) -> str | None:
    """The command that ran at `when` (a file's mtime), if one did."""
    for start, end, text in commands:
        if start - 0.01 <= when <= end:
            return text
    return None
