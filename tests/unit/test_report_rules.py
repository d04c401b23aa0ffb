"""The report's judging (api/verdict.py), the file system reading
(node/fschanges.py) and the event bus (node/events.py), without a node."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest

from corral import labels
from corral.api.models import AuditReport, Finding
from corral.api.verdict import DEFAULT_RULES, Rules, rollout_report
from corral.errors import InvalidArgument
from corral.node import events as bus
from corral.node import fschanges


def _f(kind: str, detail: str = "", count: int = 1, sandbox: str = "s") -> Finding:
    return Finding(
        kind=kind, severity=DEFAULT_RULES.severity_of(kind, detail), at=1.0, detail=detail,
        count=count, sandbox=sandbox,
    )  # fmt: skip


def test_the_verdict_is_the_worst_severity_and_info_never_counts() -> None:
    assert DEFAULT_RULES.verdict([]) == "clean"
    assert DEFAULT_RULES.verdict([_f("oom_kill"), _f("command_timeout")]) == "clean"
    assert DEFAULT_RULES.verdict([_f("egress_denied"), _f("oom_kill")]) == "suspicious"
    assert DEFAULT_RULES.verdict([_f("egress_denied"), _f("setuid")]) == "violation"
    # A reflink cp tries first is refused, and is no sign of anything.
    assert DEFAULT_RULES.verdict([_f("syscall_denied", "extent-ioctl")]) == "clean"
    assert DEFAULT_RULES.verdict([_f("syscall_denied", "privileged")]) == "suspicious"


def test_rules_rate_kinds_and_details_and_need_a_least_count() -> None:
    rules = Rules(severity={"egress_denied": "violation", "syscall_denied:privileged": "info"})
    assert rules.verdict([_f("egress_denied")]) == "violation"
    assert rules.verdict([_f("syscall_denied", "privileged")]) == "clean"
    assert rules.verdict([_f("syscall_denied", "namespace")]) == "suspicious"
    some = Rules(min_count={"egress_denied": 5})
    assert some.verdict([_f("egress_denied", count=4)]) == "clean"
    assert some.verdict([_f("egress_denied", count=4), _f("egress_denied")]) == "suspicious"
    judged = rules.judge(AuditReport(sandbox="s", findings=[_f("egress_denied")]))
    assert judged.verdict == "violation" and judged.findings[0].severity == "violation"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"severity": {"bogus": "info"}}, "severity.bogus"),
        ({"severity": {"bogus:detail": "info"}}, "severity.bogus:detail"),
        ({"severity": {"setuid": "bad"}}, "severity.setuid"),
        ({"min_count": {"setuid": 0}}, "min_count.setuid"),
        ({"min_count": {"setuid": True}}, "min_count.setuid"),
        ({"min_count": {"x": 1}}, "min_count.x"),
    ],
)
def test_bad_rules_name_the_field(kwargs: dict[str, dict[str, object]], field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        Rules(**kwargs)  # type: ignore[arg-type]
    assert err.value.field == field


def test_a_rollout_is_as_bad_as_its_worst_sandbox() -> None:
    clean = AuditReport(sandbox="a", findings=[_f("oom_kill", sandbox="a")])
    bad = AuditReport(sandbox="b", findings=[_f("setuid", sandbox="b")], verdict="violation")
    out = rollout_report("r", [clean, bad])
    assert out.verdict == "violation" and out.sandboxes == ["a", "b"] and len(out.findings) == 2
    assert rollout_report("r", []).verdict == "clean"


def _tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_the_upper_directory_shows_what_was_replaced(tmp_path: Path) -> None:
    lower, upper = tmp_path / "lower", tmp_path / "upper"
    site = "usr/local/lib/python3.11/dist-packages"
    _tree(lower, {"usr/bin/bash": "elf", "usr/bin/ls": "elf", "usr/lib/libc.so": "elf",
                  f"{site}/calc/__init__.py": "v1", f"{site}/calc/__pycache__/x.pyc": "c",
                  "work/tests/t.py": "t"})  # fmt: skip
    _tree(upper, {"usr/bin/bash": "evil", "usr/bin/ls": "x", "usr/lib/libc.so": "x",
                  f"{site}/calc/__init__.py": "v9", f"{site}/calc/__pycache__/x.pyc": "c2",
                  f"{site}/newpkg/__init__.py": "new", "usr/local/bin/tool": "new",
                  "work/tests/t.py": "edited", "tmp/x": "scratch"})  # fmt: skip
    (upper / "usr/local/bin/tool").chmod(0o4755)
    (lower / "usr/bin/gone").write_text("elf")
    try:  # a whiteout: the image's file removed (mknod 0:0 needs CAP_MKNOD)
        os.mknod(upper / "usr/bin/gone", 0o600 | stat.S_IFCHR, os.makedev(0, 0))
        removed = {("binary_replaced", "/usr/bin/gone")}
    except PermissionError:
        removed = set()
    found = {(c.kind, c.path) for c in fschanges.changes(upper, [lower], ["/work/tests"], {})}
    assert found - removed == {
        ("platform_file", "/usr/bin/bash"),
        ("binary_replaced", "/usr/bin/ls"),
        ("binary_replaced", "/usr/lib/libc.so"),
        ("package_replaced", f"/{site}/calc/__init__.py"),
        ("setuid", "/usr/local/bin/tool"),
        ("protected_write", "/work/tests/t.py"),
    }


def test_a_protected_baseline_forgives_what_was_there_when_protected(tmp_path: Path) -> None:
    upper = tmp_path / "upper"
    _tree(upper, {"work/tests/t.py": "from the harness", "work/src/a.py": "agent"})
    base = fschanges.signatures(upper, ["/work/tests"])
    assert list(base) == ["/work/tests/t.py"]
    assert fschanges.changes(upper, [], ["/work/tests"], base) == []
    (upper / "work/tests/t.py").write_text("changed by the agent, longer")
    (upper / "work/tests/new.py").write_text("added")
    found = {c.path for c in fschanges.changes(upper, [], ["/work/tests"], base)}
    assert found == {"/work/tests/t.py", "/work/tests/new.py"}


async def test_a_slow_subscriber_loses_events_and_is_told() -> None:
    events = bus.EventBus(lambda sid: {"job": "7"} if sid == "mine" else {})
    stream = events.subscribe({"job": "7"})
    assert (await anext(stream)).kind == "subscribed"
    for _ in range(bus.QUEUE + 10):
        events.publish("command", "mine", command="true")
    events.publish("command", "theirs", command="true")  # not its labels
    got = [await anext(stream)]
    assert got[0].kind == "lost" and got[0].lost == 10
    for _ in range(bus.QUEUE):
        got.append(await anext(stream))
    assert all(e.sandbox == "mine" for e in got[1:])
    with pytest.raises(asyncio.TimeoutError):
        async with asyncio.timeout(0.05):
            await anext(stream)
    await stream.aclose()  # type: ignore[attr-defined]
    assert not events.active


async def test_a_subscriber_sees_labels_but_never_a_sandboxs_secrets() -> None:
    """A stream outlives the key that opened it (until its next event): the
    sandbox's E2B tokens are not in it, and a filter on one matches none."""
    tags = {"job": "7", labels.E2B_TOKEN: "envd-secret", labels.E2B_TRAFFIC_TOKEN: "t"}
    events = bus.EventBus(lambda sid: tags)
    stream = events.subscribe({"job": "7"})
    probe = events.subscribe({labels.E2B_TOKEN: "envd-secret"})
    assert (await anext(stream)).kind == "subscribed"
    assert (await anext(probe)).kind == "subscribed"
    events.publish("state", "mine", state="running")
    got = await anext(stream)
    assert got.labels == {"job": "7", labels.E2B_TOKEN: "", labels.E2B_TRAFFIC_TOKEN: ""}
    assert "envd-secret" not in got.model_dump_json()
    with pytest.raises(asyncio.TimeoutError):
        async with asyncio.timeout(0.05):
            await anext(probe)
    for s in (stream, probe):
        await s.aclose()  # type: ignore[attr-defined]


def test_publishing_without_subscribers_costs_no_lookup() -> None:
    def labels_of(_sid: str) -> dict[str, str]:
        raise AssertionError("looked up with nobody listening")

    bus.EventBus(labels_of).publish("state", "x", state="running")


def test_a_walk_cut_short_says_so_and_counts_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sandbox makes its upper directory: past MAX_ENTRIES entries of
    any kind (empty directories too: they cost the host as much) the walk
    stops, and the finding says what was not checked, so junk cannot hide
    a replaced binary. A protected path not reached is not called removed."""
    monkeypatch.setattr(fschanges, "MAX_ENTRIES", 50)
    upper = tmp_path / "upper"
    for i in range(200):
        (upper / "junk" / f"d{i}").mkdir(parents=True)
    base = {"/work/tests/t.py": ("file", 1, 1)}
    found = fschanges.changes(upper, [], ["/work/tests"], base)
    assert [c.kind for c in found] == ["changes_unread"]
    assert "more than 50 entries" in found[0].detail
    assert sum(1 for _ in fschanges.entries(upper)) == 0  # no files, and it ended
    small = tmp_path / "small"
    _tree(small, {"a/b": "x"})
    assert fschanges.changes(small, [], [], {}) == []
