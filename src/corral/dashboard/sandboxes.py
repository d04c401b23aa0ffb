"""The sandboxes pages: the filtered, paginated list and one sandbox's detail."""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from corral import labels as platform_labels
from corral.api.models import AuditReport, LogLine, SandboxInfo
from corral.dashboard import scripts
from corral.dashboard.render import (
    VERDICT_TONE,
    Safe,
    badge,
    esc,
    href,
    join,
    kv_table,
    link,
    seconds,
    size,
    state_badge,
    table,
    tag,
    when,
)
from corral.dashboard.scope import ALL_STATES, Row, Scope
from corral.errors import CorralError

PAGE_SIZE = 200  # rows a list page renders, whatever the total


@dataclass(frozen=True)
class Filter:
    """The list's query: every field optional; `label` is ``k=v``; `q` a
    substring of the id."""

    state: str = ""
    kind: str = ""
    image: str = ""
    label: str = ""
    q: str = ""
    page: int = 1

    @classmethod
    def parse(cls, params: Mapping[str, str]) -> Filter:
        try:
            page = max(1, int(params.get("page", "1")))
        except ValueError:
            page = 1
        return cls(
            state=params.get("state", "").strip(),
            kind=params.get("kind", "").strip(),
            image=params.get("image", "").strip(),
            label=params.get("label", "").strip(),
            q=params.get("q", "").strip(),
            page=page,
        )

    def labels(self) -> dict[str, str] | None:
        """The label filter, for the store's own (indexed) label match; a
        value without `=` matches a label key with any value (matches())."""
        if "=" not in self.label:
            return None
        k, _, v = self.label.partition("=")
        return {k.strip(): v.strip()}

    def matches(self, r: Row) -> bool:
        if self.state and r.state != self.state:
            return False
        if self.kind and r.kind != self.kind:
            return False
        if self.image and self.image not in r.image:
            return False
        if self.q and self.q not in r.id:
            return False
        if self.label:
            want = self.labels()
            if want is None:
                return self.label in r.labels
            return all(r.labels.get(k) == v for k, v in want.items())
        return True

    def params(self, **change: str | int) -> dict[str, str | int | None]:
        out: dict[str, str | int | None] = {
            "state": self.state,
            "kind": self.kind,
            "image": self.image,
            "label": self.label,
            "q": self.q,
            "page": self.page if self.page > 1 else None,
        }
        out.update(change)
        return out


@dataclass
class Listing:
    """One page of the filtered rows, and the counts over all of them."""

    rows: list[Row]
    matched: int
    total: int
    page: int
    pages: int
    by_state: Counter[str] = field(default_factory=Counter)
    by_kind: Counter[str] = field(default_factory=Counter)


def paginate(rows: Sequence[Row], f: Filter, page_size: int = PAGE_SIZE) -> Listing:
    """Newest first; the counts are over every row the caller sees, so the
    links at the top say what each filter would find."""
    matched = [r for r in rows if f.matches(r)]
    matched.sort(key=lambda r: r.created_at, reverse=True)
    pages = max(1, math.ceil(len(matched) / page_size))
    page = min(f.page, pages)
    start = (page - 1) * page_size
    return Listing(
        rows=matched[start : start + page_size],
        matched=len(matched),
        total=len(rows),
        page=page,
        pages=pages,
        by_state=Counter(r.state for r in rows),
        by_kind=Counter(r.kind for r in rows),
    )


def _labels(labels: Mapping[str, str]) -> Safe:
    # A sandbox's secrets are not page content (screenshots, screen shares,
    # the browser's cache): its E2B tokens are read with the API.
    shown = sorted((k, v) for k, v in labels.items() if k not in platform_labels.SECRETS)
    return join((tag("code", f"{k}={v}") for k, v in shown), " ")


def _counts(title: str, name: str, counts: Counter[str], f: Filter) -> Safe:
    items = [
        tag(
            "span",
            link(href("/ui", f.params(**{name: key, "page": ""})), key)
            + Safe(f" {tag('b', n, data_count=f'{name}:{key}')}"),
        )
        for key, n in sorted(counts.items())
    ]
    return tag("div", Safe(f"{esc(title)}: ") + join(items), class_="counts", id=f"counts-{name}")


def _filter_form(f: Filter, kinds: Sequence[str]) -> Safe:
    def select(name: str, options: Sequence[str], current: str) -> Safe:
        opts = tag("option", "any", value="") + join(
            tag("option", o, value=o, selected="selected" if o == current else None)
            for o in options
        )
        return tag("label", Safe(f"{name} ") + tag("select", opts, name=name))

    def text(name: str, value: str, hint: str) -> Safe:
        box = Safe(
            f'<input type="text" name="{name}" value="{esc(value)}" placeholder="{esc(hint)}">'
        )
        return tag("label", Safe(f"{name} ") + box)

    return tag(
        "form",
        select("state", ALL_STATES, f.state)
        + select("kind", kinds, f.kind)
        + text("image", f.image, "substring")
        + text("label", f.label, "key=value")
        + text("q", f.q, "id contains")
        + Safe('<button type="submit">filter</button> ')
        + link("/ui", "clear"),
        method="get",
        action="/ui",
        class_="filters",
        id="filters",
    )


def sandbox_table(rows: Sequence[Row]) -> Safe:
    head = join(tag("th", h) for h in ("id", "state", "kind", "image", "node", "labels", "created"))
    body = join(
        tag(
            "tr",
            tag("td", link(f"/ui/sandboxes/{quote(r.id, safe='')}", r.id, class_="sbx"))
            + tag("td", state_badge(r.state), class_="state")
            + tag("td", r.kind)
            + tag("td", r.image)
            + tag("td", r.node)
            + tag("td", _labels(r.labels))
            + tag("td", when(r.created_at)),
            data_sandbox=r.id,
        )
        for r in rows
    )
    return tag(
        "table", Safe(f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody>"), id="sandboxes"
    )


def _pager(listing: Listing, f: Filter) -> Safe:
    parts: list[Safe] = []
    if listing.page > 1:
        parts.append(link(href("/ui", f.params(page=listing.page - 1)), "« previous", id="prev"))
    parts.append(
        tag(
            "span", f"page {listing.page} of {listing.pages} ({listing.matched} matched)", id="page"
        )
    )
    if listing.page < listing.pages:
        parts.append(link(href("/ui", f.params(page=listing.page + 1)), "next »", id="next"))
    return tag("p", join(parts, " "), class_="pager")


def list_body(listing: Listing, f: Filter) -> Safe:
    kinds = sorted(set(listing.by_kind) | {"container", "microvm", "fullvm"})
    events = href("/v1/events", {"label": f.label if "=" in f.label else None})
    return (
        tag("p", f"{listing.total} sandboxes", id="total")
        + _counts("by state", "state", listing.by_state, f)
        + _counts("by kind", "kind", listing.by_kind, f)
        + _filter_form(f, kinds)
        + tag("div", "", id="live-hint", data_events=events)
        + _pager(listing, f)
        + sandbox_table(listing.rows)
        + scripts.script(scripts.LIVE)
    )


async def list_page(scope: Scope, f: Filter) -> Safe:
    rows = await scope.rows(f.labels())
    return list_body(paginate(rows, f), f)


# ---------------------------------------------------------------- one sandbox


@dataclass
class Timeline:
    """A sandbox's command log, read as the node wrote it."""

    events: list[tuple[float | None, str, str]] = field(default_factory=list)
    commands: list[dict[str, Any]] = field(default_factory=list)


def _argv(doc: Mapping[str, Any]) -> str:
    argv = doc.get("argv")
    if isinstance(argv, list):
        return " ".join(str(a) for a in argv)
    return str(argv or doc.get("command") or "")


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def parse_log(lines: Sequence[LogLine]) -> Timeline:
    """State changes, commands, findings and markers, oldest first; a line
    that is not a JSON object is shown as it is, never dropped."""
    out = Timeline()
    for ll in lines:
        try:
            doc = json.loads(ll.line)
        except ValueError:
            doc = None
        if not isinstance(doc, dict):
            out.events.append((ll.ts, "unreadable", ll.line[:200]))
            continue
        ts = _num(doc.get("ts")) or ll.ts
        event = doc.get("event")
        if event == "state":
            out.events.append((ts, "state", str(doc.get("state", ""))))
        elif event == "finding":
            found = doc.get("finding")
            what = found if isinstance(found, dict) else {}
            detail = (
                f"{what.get('kind', '?')} ({what.get('severity', '?')}) {what.get('detail', '')}"
            )
            out.events.append((ts, "finding", detail.strip()))
        elif event is not None:
            out.events.append((ts, "marker", str(event)))
        else:
            cmd = {**doc, "ts": ts, "command": _argv(doc)}
            out.commands.append(cmd)
            code = doc.get("exit_code")
            end = f"exit {code}" if code is not None else str(doc.get("outcome", "?"))
            out.events.append((ts, "command", f"{cmd['command']} → {end}"))
    return out


def _commands_table(commands: Sequence[Mapping[str, Any]]) -> Safe:
    if not commands:
        return tag("p", "no commands logged", class_="muted")
    rows = [
        (
            when(_num(c.get("ts"))),
            tag("code", c.get("command", "")),
            c.get("user") or "",
            c.get("outcome") or "",
            tag(
                "span",
                "-" if c.get("exit_code") is None else str(c.get("exit_code")),
                class_="exit " + ("ok" if c.get("exit_code") == 0 else "bad"),
            ),
            c.get("signal") or "",
            seconds(_num(c.get("seconds"))),
            size(int(c.get("stdout_bytes") or 0)),
            size(int(c.get("stderr_bytes") or 0)),
        )
        for c in commands
    ]
    heads = ("at", "command", "user", "outcome", "exit", "signal", "took", "stdout", "stderr")
    return table(heads, rows, id="commands")


def _timeline_table(info: SandboxInfo, tl: Timeline) -> Safe:
    rows: list[tuple[float | None, str, str]] = [(info.created_at, "state", "created")]
    rows += tl.events
    rows.sort(key=lambda e: e[0] or 0.0)
    return table(
        ("at", "what", "detail"),
        ((when(ts), what, detail) for ts, what, detail in rows),
        id="timeline",
    )


_COUNTERS = (
    "commands",
    "commands_timed_out",
    "commands_killed",
    "oom_kills",
    "pids_limit_hits",
    "egress_denied",
    "dns_denied",
    "output_dropped_bytes",
    "log_quota_hits",
)


def report_section(report: AuditReport) -> Safe:
    verdict = str(getattr(report, "verdict", "clean"))
    findings = getattr(report, "findings", [])
    head = tag(
        "p", Safe("verdict: ") + badge(verdict, VERDICT_TONE.get(verdict, "muted")), id="verdict"
    )
    counters = tag(
        "p",
        join((f"{k}: {getattr(report, k, 0)}" for k in _COUNTERS), " · "),
        class_="muted",
        id="counters",
    )
    if not findings:
        return head + counters + tag("p", "no findings", id="findings")
    rows = [
        (f.kind, badge(f.severity, VERDICT_TONE.get(f.severity, "muted")), when(f.at),
         tag("code", f.command or ""), f.detail, f.count)
        for f in findings
    ]  # fmt: skip
    heads = ("kind", "severity", "at", "command", "detail", "count")
    return head + counters + table(heads, rows, id="findings")


def _spec(info: SandboxInfo) -> Safe:
    pairs: list[tuple[str, Any]] = [
        ("id", info.id),
        ("state", state_badge(info.state.value)),
        ("kind", info.kind),
        ("node", info.node),
        ("image", info.image),
        ("workspace", info.workspace or "-"),
        ("toolkit", ", ".join(info.toolkit) or "-"),
        ("cpu", info.cpu),
        ("memory", size(info.memory)),
        ("disk", size(info.disk)),
        ("pids", info.pids),
        ("ttl", "-" if info.ttl is None else f"{info.ttl:g} s"),
        ("idle timeout", "-" if info.idle_timeout is None else f"{info.idle_timeout:g} s"),
        ("created", when(info.created_at)),
        ("expires", when(info.expires_at)),
        ("workdir", info.workdir),
        ("address", info.address or "-"),
        ("suspended", info.suspended or "-"),
        ("error", info.error or "-"),
        ("labels", _labels(info.labels)),
        ("env", join((tag("code", k) for k in sorted(info.env)), " ") or "-"),
        ("layers", len(info.layers)),
    ]
    return kv_table(pairs)


async def detail_page(scope: Scope, info: SandboxInfo) -> Safe:
    sid = info.id
    try:
        lines = await scope.svc.command_log(sid, limit=1000)
        tl = parse_log(lines)
        log_note = Safe("")
    except CorralError as exc:
        tl, log_note = Timeline(), tag("p", f"command log unavailable: {exc}", class_="muted")
    try:
        report = report_section(await scope.svc.audit(sid))
    except CorralError as exc:
        report = tag("p", f"report unavailable: {exc}", class_="muted")
    path = quote(sid, safe="")
    screen = (
        tag("h2", "screen")
        + Safe(
            f'<img id="screenshot" alt="screenshot" src="/v1/sandboxes/{path}/display/screenshot">'
        )
        if info.kind == "fullvm"
        else Safe("")
    )
    usage = (
        tag("h2", "resource use")
        + tag("div", "", id="usage", data_url=f"/v1/sandboxes/{path}/usage")
        + scripts.script(scripts.USAGE)
    )
    return (
        tag("h2", "spec")
        + _spec(info)
        + usage
        + screen
        + tag("h2", "misbehaviour report")
        + report
        + tag("h2", "commands")
        + log_note
        + _commands_table(tl.commands)
        + tag("h2", "timeline")
        + _timeline_table(info, tl)
    )
