"""The dashboard's renderers (escaping, pagination, filters, the command
log), its metrics ring, and its gateway pages and login against a real
gateway on SQLite (projects, keys and a node's heartbeat in its store).
The node pages in a real browser: tests/integration/test_dashboard.py."""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from corral.api.app import create_app
from corral.api.models import AuditReport, LogLine
from corral.api.models_report import Finding
from corral.capacity import NodeCapacity
from corral.control import nodes, quotas
from corral.control.gateway import Gateway
from corral.control.keys import create_key
from corral.dashboard import add_dashboard
from corral.dashboard.metrics_ring import Ring, quantile, sample
from corral.dashboard.nodes import pressure
from corral.dashboard.render import esc, svg_lines, tag
from corral.dashboard.sandboxes import (
    PAGE_SIZE,
    Filter,
    list_body,
    paginate,
    parse_log,
    report_section,
)
from corral.dashboard.scope import Row
from corral.db import connect

EVIL = '<script>alert("x")</script>'


def rows(n: int, **over: object) -> list[Row]:
    base = time.time()
    out = []
    for i in range(n):
        doc: dict[str, object] = {
            "id": f"t-{i:016x}",
            "state": ("running", "suspended", "closed")[i % 3],
            "kind": "fullvm" if i % 10 == 0 else "container",
            "image": "debian-python:bookworm" if i % 2 else "alpine:3",
            "node": "t",
            "created_at": base + i,
            "labels": {"job": f"j{i % 4}"},
        }
        doc.update(over)
        out.append(Row(**doc))  # type: ignore[arg-type]
    return out


# ---------------------------------------------------------------- escaping


def test_hostile_labels_and_ids_are_escaped_everywhere_they_are_shown() -> None:
    hostile = Row(
        id='t-"><img src=x onerror=alert(1)>',
        state="running",
        kind="container",
        image=EVIL,
        node="t",
        created_at=time.time(),
        labels={EVIL: EVIL, "k": "v\"'&"},
    )
    f = Filter(label=f"{EVIL}={EVIL}", q='"><b>')
    html = list_body(paginate([hostile], Filter()), f)
    assert "<script>alert" not in html
    assert "<img src=x" not in html
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in html
    assert 'value="&quot;&gt;&lt;b&gt;"' in html  # the filter form echoes it escaped
    # The one script on the page is the dashboard's own.
    assert html.count("<script>") == 1


def test_safe_markup_composes_without_double_escaping_and_escapes_what_is_added() -> None:
    both = tag("b", "<1>") + tag("i", "2")
    assert both == "<b>&lt;1&gt;</b><i>2</i>"
    assert tag("p", both) == "<p><b>&lt;1&gt;</b><i>2</i></p>"
    assert tag("b", "x") + EVIL == "<b>x</b>" + str(esc(EVIL))
    assert EVIL + tag("b", "x") == str(esc(EVIL)) + "<b>x</b>"


def test_a_report_with_hostile_findings_is_escaped() -> None:
    report = AuditReport(
        sandbox="t-1",
        findings=[
            Finding(kind="egress_denied", severity="suspicious", at=1.0, command=EVIL, detail=EVIL)
        ],
        verdict="suspicious",
    )
    html = report_section(report)
    assert "<script>" not in html
    assert 'class="badge warn">suspicious' in html
    assert html.count("&lt;script&gt;") == 2


# ---------------------------------------------------------------- pagination and filters


def test_a_page_holds_at_most_page_size_rows_and_the_counts_cover_all() -> None:
    many = rows(2 * PAGE_SIZE + 50)
    first = paginate(many, Filter())
    assert (first.pages, first.page, len(first.rows), first.matched) == (3, 1, PAGE_SIZE, 450)
    assert first.rows[0].created_at == max(r.created_at for r in many)  # newest first
    assert first.by_state == {"running": 150, "suspended": 150, "closed": 150}
    last = paginate(many, Filter(page=3))
    assert len(last.rows) == 50
    assert not {r.id for r in last.rows} & {r.id for r in first.rows}
    assert paginate(many, Filter(page=99)).page == 3  # past the end: the last page
    html = list_body(first, Filter())
    assert html.count("data-sandbox=") == PAGE_SIZE
    assert 'href="/ui?page=2"' in html and 'id="prev"' not in html


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"state": "suspended"}, 10),
        ({"kind": "fullvm"}, 3),
        ({"image": "python"}, 15),
        ({"label": "job=j1"}, 8),
        ({"label": "job"}, 30),
        ({"label": "job=nope"}, 0),
        ({"q": "000000000000001"}, 15),  # ids 0x01 and 0x10 to 0x1d
        ({"state": "running", "kind": "fullvm"}, 1),
        ({"page": "x", "state": "closed"}, 10),
    ],
)
def test_filters_narrow_the_list(params: dict[str, str], expected: int) -> None:
    assert paginate(rows(30), Filter.parse(params)).matched == expected


def test_the_filter_survives_into_the_pager_and_the_event_stream() -> None:
    f = Filter.parse({"state": "running", "label": "job=j1"})
    html = list_body(paginate(rows(6000), f), f)  # 500 match: 3 pages
    assert 'href="/ui?state=running&amp;label=job%3Dj1&amp;page=2"' in html
    assert 'data-events="/v1/events?label=job%3Dj1"' in html


# ---------------------------------------------------------------- the command log


def test_the_command_log_is_read_tolerantly() -> None:
    lines = [
        {"ts": 1.0, "event": "state", "state": "running"},
        {"ts": 2.0, "argv": ["sh", "-c", "exit 3"], "user": "root", "outcome": "exited",
         "exit_code": 3, "signal": None, "stdout_bytes": 0, "stderr_bytes": 5, "seconds": 0.01},
        {"ts": 3.0, "event": "finding", "finding": {"kind": "oom_kill", "severity": "info"}},
        {"event": "log quota reached"},
    ]  # fmt: skip
    log = [LogLine(ts=i + 1.0, line=json.dumps(d)) for i, d in enumerate(lines)]
    log += [LogLine(ts=9.0, line="not json {"), LogLine(ts=10.0, line="[1, 2]")]
    tl = parse_log(log)
    assert [c["command"] for c in tl.commands] == ["sh -c exit 3"]
    assert [what for _, what, _ in tl.events] == [
        "state", "command", "finding", "marker", "unreadable", "unreadable",
    ]  # fmt: skip
    assert tl.events[1][2] == "sh -c exit 3 → exit 3"
    assert tl.events[3] == (4.0, "marker", "log quota reached")  # no ts: the line's


# ---------------------------------------------------------------- metrics


def test_the_ring_turns_counters_into_rates_and_buckets_into_quantiles() -> None:
    reg = CollectorRegistry()
    created = Counter("corral_sandboxes_created_total", "", ["kind"], registry=reg)
    failed = Counter("corral_node_full_total", "", ["reason"], registry=reg)
    hist = Histogram(
        "corral_sandbox_create_seconds", "", ["kind"], buckets=(0.01, 0.1, 1), registry=reg
    )
    ring = Ring(interval=5)
    ring.take(sample(reg, at=100.0))
    created.labels("container").inc(50)
    failed.labels("memory").inc(2)
    for _ in range(98):
        hist.labels("container").observe(0.05)
    hist.labels("container").observe(0.5)
    hist.labels("container").observe(5)
    ring.take(sample(reg, at=110.0))
    assert ring.create_rate() == [(110.0, 5.0)]
    assert ring.failures() == {"node full: memory": [(110.0, 2.0)]}
    assert ring.latency("corral_sandbox_create_seconds") == {
        "p50": [(110.0, 0.1)],
        "p99": [(110.0, 1.0)],
    }
    assert quantile({}, 0.5) is None


def test_charts_are_svg_and_escape_their_legend() -> None:
    svg = svg_lines({EVIL: [(0.0, 1.0), (1.0, 2.0)]})
    assert svg.startswith("<svg") and "<polyline" in svg and "<script" not in svg
    assert "no samples yet" in svg_lines({"x": []})


def test_pressure_reads_psi_and_says_when_there_is_none(tmp_path: Path) -> None:
    (tmp_path / "cpu").write_text(
        "some avg10=1.50 avg60=0.20 avg300=0.00 total=1\nfull avg10=0.00 avg60=0 avg300=0 total=0\n"
    )
    assert pressure(tmp_path) == {"cpu": "some 1.50%, full 0.00%"}
    assert pressure(tmp_path / "absent") == {}


# ---------------------------------------------------------------- a real gateway


@pytest.fixture
async def gateway(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, str]]]:
    db = await connect(f"sqlite:///{tmp_path}/state.db")
    gw = await Gateway(db, node_key=None).start(sweep=False)
    await quotas.create_project(db, "org", max_sandboxes=10, max_cpu=8.0, operator=True)
    await quotas.create_project(db, "team", parent="org", max_sandboxes=5)
    await quotas.create_project(db, "job", parent="team")
    await quotas.create_project(db, "rival", parent="org")
    await quotas.create_project(db, "other-org")
    keys = {p: (await create_key(db, p))[0] for p in ("org", "job", "other-org")}
    # A node that heartbeats but is not listening: a list through the
    # gateway skips it (and says so in the log), the nodes page shows it.
    cap = NodeCapacity(max_sandboxes=64, active=3, held=2, memory_budget=2**34, cpus=16)
    await nodes.heartbeat(db, "n1", "http://127.0.0.1:9", cap)
    app = create_app(
        None, for_token=gw.for_token, for_sandbox=gw.for_sandbox, operator=gw.is_operator
    )
    ring = add_dashboard(app, app.state.resolve, gateway=gw)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        yield c, keys
    await ring.stop()
    await gw.aclose()
    await db.aclose()


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def test_gateway_pages_show_an_operator_every_node_and_project(
    gateway: tuple[httpx.AsyncClient, dict[str, str]],
) -> None:
    c, keys = gateway
    r = await c.get("/ui/nodes", headers=_bearer(keys["org"]))
    assert r.status_code == 200, r.text
    assert "n1" in r.text and "3 / 64" in r.text and ">alive<" in r.text
    r = await c.get("/ui/projects", headers=_bearer(keys["org"]))
    names = re.findall(r'class="project">([^<]+)<', r.text)
    assert names == ["org", "rival", "team", "job", "other-org"]
    assert "0 / 10" in r.text and "0 / 8" in r.text
    r = await c.get("/ui", headers=_bearer(keys["org"]))
    assert r.status_code == 200 and "0 sandboxes" in r.text


async def test_a_project_key_sees_its_chain_and_subtree_and_no_nodes(
    gateway: tuple[httpx.AsyncClient, dict[str, str]],
) -> None:
    c, keys = gateway
    r = await c.get("/ui/projects", headers=_bearer(keys["job"]))
    assert re.findall(r'class="project">([^<]+)<', r.text) == ["org", "team", "job"]
    r = await c.get("/ui/nodes", headers=_bearer(keys["job"]))
    assert r.status_code == 200 and "n1" not in r.text and "operator" in r.text


async def test_a_root_project_is_a_tenant_unless_made_an_operator(
    gateway: tuple[httpx.AsyncClient, dict[str, str]],
) -> None:
    """Before, every root project's key was the operator's: any tenant
    made with `corral project create NAME` saw every project and node, and
    any key read the gateway's metrics."""
    c, keys = gateway
    tenant = _bearer(keys["other-org"])
    r = await c.get("/ui/projects", headers=tenant)
    assert re.findall(r'class="project">([^<]+)<', r.text) == ["other-org"]
    r = await c.get("/ui/nodes", headers=tenant)
    assert "n1" not in r.text and "operator" in r.text
    r = await c.get("/ui/metrics", headers=tenant)
    assert "shown to an operator" in r.text
    r = await c.get("/metrics", headers=tenant)
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    assert (await c.get("/metrics", headers=_bearer(keys["job"]))).status_code == 403
    r = await c.get("/metrics", headers=_bearer(keys["org"]))
    assert r.status_code == 200 and "corral_" in r.text


@pytest.mark.parametrize(
    ("headers", "refused"),
    [
        ({"sec-fetch-site": "cross-site"}, "Sec-Fetch-Site: cross-site"),
        # A sandbox's own page, served from a sibling host of the gateway's.
        ({"sec-fetch-site": "same-site"}, "Sec-Fetch-Site: same-site"),
        ({"origin": "https://evil.example"}, "Origin: https://evil.example"),
        ({"origin": "null"}, "Origin: null"),
        ({"origin": "http://gw:8080"}, "Origin: http://gw:8080"),
        ({"sec-fetch-site": "same-origin"}, None),
        ({"sec-fetch-site": "none"}, None),  # typed in, a bookmark
        ({"origin": "http://gw"}, None),
        ({"origin": "https://corral.example", "x-forwarded-host": "corral.example"}, None),
        ({}, None),  # a program: no browser headers
    ],
)
async def test_a_browser_request_from_another_site_changes_nothing(
    gateway: tuple[httpx.AsyncClient, dict[str, str]], headers: dict[str, str], refused: str | None
) -> None:
    """Login CSRF (another site logs the victim's dashboard into its own
    key), and any write a page elsewhere could post to a keyless server."""
    c, keys = gateway
    r = await c.post("/ui/login", data={"key": keys["job"], "next": "/ui"}, headers=headers)
    if refused is None:
        assert r.status_code == 303 and "corral_key=" in r.headers["set-cookie"]
        return
    assert r.status_code == 403 and "set-cookie" not in r.headers
    error = r.json()["error"]
    assert error["code"] == "permission_denied" and error["reason"] == refused
    # Reads still pass (a cross-site page cannot read the answer anyway).
    assert (await c.get("/healthz", headers=headers)).status_code == 200


async def test_login_sets_a_strict_http_only_cookie_that_only_reads_accept(
    gateway: tuple[httpx.AsyncClient, dict[str, str]],
) -> None:
    c, keys = gateway
    r = await c.get("/ui/projects")
    assert r.status_code == 401 and 'id="login"' in r.text
    r = await c.post("/ui/login", data={"key": "ck_wrong", "next": "/ui/projects"})
    assert r.status_code == 401 and "refused" in r.text and "set-cookie" not in r.headers
    r = await c.post("/ui/login", data={"key": keys["job"], "next": "https://evil.example/"})
    assert r.status_code == 303 and r.headers["location"] == "/ui"  # never off-site
    r = await c.post("/ui/login", data={"key": keys["job"], "next": "/ui/projects"})
    assert r.status_code == 303 and r.headers["location"] == "/ui/projects"
    cookie = r.headers["set-cookie"].lower()
    assert "corral_key=" in cookie and "httponly" in cookie and "samesite=strict" in cookie
    assert "secure" not in cookie  # plain HTTP here: a Secure cookie would never come back
    assert (await c.get("/ui/projects")).status_code == 200  # the client kept the cookie
    assert (await c.get("/v1/sandboxes")).status_code == 200  # an API read, by cookie
    # A write by cookie alone is refused: a cross-site form can send nothing else.
    r = await c.post("/v1/sandboxes", json={"image": "debian-python:bookworm"})
    assert r.status_code == 401, r.text
    r = await c.post("/ui/logout")
    assert r.status_code == 303
    assert (await c.get("/ui/projects")).status_code == 401
    behind_tls = await c.post(
        "/ui/login",
        data={"key": keys["job"], "next": "/ui"},
        headers={"x-forwarded-proto": "https"},
    )
    # Under https the cookie is __Host- prefixed: no sibling host can set one
    # in its place, and it is the one the API reads.
    assert behind_tls.headers["set-cookie"].startswith("__Host-corral_key=")
    assert "secure" in behind_tls.headers["set-cookie"].lower()


async def test_a_page_runs_only_its_own_scripts_and_is_framed_nowhere(
    gateway: tuple[httpx.AsyncClient, dict[str, str]],
) -> None:
    """A missed escape is then harmless: an injected script or style does
    not run, and no other site frames the page (clickjacking)."""
    c, keys = gateway
    for r in (await c.get("/ui/projects"), await c.get("/ui", headers=_bearer(keys["org"]))):
        csp = r.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
        assert "'unsafe-inline'" not in csp and csp.count("'sha256-") == 3
        assert r.headers["x-frame-options"] == "DENY" and r.headers["cache-control"] == "no-store"
        assert r.headers["x-content-type-options"] == "nosniff"


def test_text_that_hides_itself_is_shown() -> None:
    """A sandbox names its files and commands: a bidi override or a zero-
    width mark must not make one read as another to the operator."""
    assert esc("evil\u202eexe.sh") == "evil\\u202eexe.sh"
    assert esc("a\u200bb\x1b[31m") == "a\\u200bb\\u001b[31m"
    assert esc("line\nnext\ttab <b>") == "line\nnext\ttab &lt;b&gt;"
