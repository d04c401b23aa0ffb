"""Judging a report: severities per kind of finding, and the verdict.

The node judges with DEFAULT_SEVERITY. A trainer that filters rewards on
its own terms builds Rules (a severity per kind it cares about, a least
count before a kind counts at all) and re-judges what the node sent:

    rules = Rules(severity={"egress_denied": "info"}, min_count={"syscall_denied": 3})
    report = rules.judge(await sbx.audit())
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TypeVar, get_args

from pydantic import BaseModel

from corral.api.models import (
    DEFAULT_SEVERITY,
    FINDING_KINDS,
    AuditReport,
    Finding,
    RolloutReport,
    Severity,
    Verdict,
)
from corral.errors import InvalidArgument

_ORDER: dict[str, int] = {"info": 0, "suspicious": 1, "violation": 2}
_VERDICT: dict[int, Verdict] = {0: "clean", 1: "suspicious", 2: "violation"}
SEVERITIES = get_args(Severity)

R = TypeVar("R", bound=BaseModel)


@dataclass(frozen=True)
class Rules:
    severity: dict[str, Severity] = field(default_factory=dict)
    min_count: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, sev in self.severity.items():
            kind = key.split(":", 1)[0]
            if kind not in FINDING_KINDS:
                raise InvalidArgument(
                    f"severity.{key}", f"must be a kind (or kind:detail) of {FINDING_KINDS}", key
                )
            if sev not in SEVERITIES:
                raise InvalidArgument(f"severity.{key}", f"must be one of {SEVERITIES}", sev)
        for kind, n in self.min_count.items():
            if kind not in FINDING_KINDS:
                raise InvalidArgument(f"min_count.{kind}", f"must be one of {FINDING_KINDS}", kind)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise InvalidArgument(f"min_count.{kind}", "must be an integer >= 1", n)

    def severity_of(self, kind: str, detail: str = "") -> Severity:
        """The caller's rating of kind:detail, else of kind, else the node's."""
        for table in (self.severity, DEFAULT_SEVERITY):
            for key in (f"{kind}:{detail}", kind):
                if key in table:
                    return table[key]
        return "suspicious"

    def rated(self, findings: Iterable[Finding]) -> list[Finding]:
        """The findings with this rule set's severities."""
        return [
            f.model_copy(update={"severity": self.severity_of(f.kind, f.detail)}) for f in findings
        ]

    def verdict(self, findings: Iterable[Finding]) -> Verdict:
        """The worst severity among the kinds that reach their least count."""
        counts: dict[str, int] = {}
        worst_of: dict[str, int] = {}
        for f in findings:
            counts[f.kind] = counts.get(f.kind, 0) + f.count
            rank = _ORDER[self.severity_of(f.kind, f.detail)]
            worst_of[f.kind] = max(worst_of.get(f.kind, 0), rank)
        worst = 0
        for kind, n in counts.items():
            if n >= self.min_count.get(kind, 1):
                worst = max(worst, worst_of[kind])
        return _VERDICT[worst]

    def judge(self, report: R) -> R:
        """A copy of an AuditReport or RolloutReport judged by these rules."""
        findings = self.rated(getattr(report, "findings"))  # noqa: B009 (either model)
        return report.model_copy(update={"findings": findings, "verdict": self.verdict(findings)})


DEFAULT_RULES = Rules()


def rollout_report(rollout: str, reports: Iterable[AuditReport]) -> RolloutReport:
    """Sandboxes' reports as one rollout's: all findings, the worst verdict."""
    out = RolloutReport(rollout=rollout)
    worst = 0
    for r in reports:
        out.sandboxes.append(r.sandbox)
        out.findings += r.findings
        worst = max(worst, _RANK[r.verdict])
    out.findings.sort(key=lambda f: f.at)
    out.verdict = _VERDICT[worst]
    return out


def worst(findings: Iterable[Finding]) -> Verdict:
    """The verdict of findings as rated (their severities, no counts)."""
    return _VERDICT[max((_ORDER[f.severity] for f in findings), default=0)]


_RANK: dict[str, int] = {v: k for k, v in _VERDICT.items()}
