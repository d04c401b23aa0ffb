"""HTML and SVG for the dashboard's pages, with escaping by default.

Everything a sandbox can choose (its labels, its commands' argv, its
findings' details) is hostile: a plain `str` handed to these helpers is
always escaped; only `Safe` (markup these helpers built) passes as is.
"""

from __future__ import annotations

import html
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from urllib.parse import urlencode

from corral.units import format_size


class Safe(str):
    """Markup built here from escaped parts: never wrap outside input in it."""

    __slots__ = ()

    # str's + would return a plain str, which the next helper escapes again:
    # Safe + Safe stays Safe; anything else added is escaped first.
    def __add__(self, other: str) -> Safe:
        return Safe(str.__add__(self, esc(other)))

    def __radd__(self, other: str) -> Safe:
        return Safe(str.__add__(esc(other), self))


Cell = str | int | float | None


# Characters that change how text reads without showing themselves: control
# characters (but line breaks and tabs), and Unicode's invisible formatting
# (bidi overrides, zero-width marks). A sandbox names its files and commands:
# "evil\u202eexe.sh" must not read as something else to the operator.
_HIDDEN = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff\ufff9-\ufffb]"
)


def _shown(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def esc(value: Cell) -> Safe:
    if isinstance(value, Safe):
        return value
    text = _HIDDEN.sub(_shown, "" if value is None else str(value))
    return Safe(html.escape(text, quote=True))


def join(parts: Iterable[Cell], sep: str = "") -> Safe:
    return Safe(sep.join(esc(p) for p in parts))


def tag(name: str, body: Cell = "", /, **attrs: Cell) -> Safe:
    """<name attrs>body</name>; attribute names as Python keywords
    (class_ -> class, data_x -> data-x); None drops the attribute."""
    at = "".join(
        f' {k.rstrip("_").replace("_", "-")}="{esc(v)}"' for k, v in attrs.items() if v is not None
    )
    return Safe(f"<{name}{at}>{esc(body)}</{name}>")


def link(url: str, body: Cell, /, **attrs: Cell) -> Safe:
    return tag("a", body, href=url, **attrs)


def href(path: str, params: Mapping[str, str | int | None]) -> str:
    kept = {k: v for k, v in params.items() if v not in (None, "")}
    return f"{path}?{urlencode(kept)}" if kept else path


def table(headers: Sequence[str], rows: Iterable[Sequence[Cell]], **attrs: Cell) -> Safe:
    head = join(tag("th", h) for h in headers)
    body = join(tag("tr", join(tag("td", c) for c in row)) for row in rows)
    return tag("table", Safe(f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody>"), **attrs)


def kv_table(pairs: Iterable[tuple[str, Cell]]) -> Safe:
    return tag(
        "table",
        join(tag("tr", tag("th", k) + tag("td", v)) for k, v in pairs),
        class_="kv",
    )


def badge(text: str, tone: str) -> Safe:
    return tag("span", text, class_=f"badge {tone}")


VERDICT_TONE = {"clean": "ok", "suspicious": "warn", "violation": "bad"}
STATE_TONE = {
    "running": "ok",
    "creating": "info",
    "resuming": "info",
    "suspending": "info",
    "suspended": "warn",
    "closing": "info",
    "closed": "muted",
    "failed": "bad",
}


def state_badge(state: str) -> Safe:
    return badge(state, STATE_TONE.get(state, "muted"))


def size(n: int | None) -> str:
    return "-" if n is None else format_size(n)


def when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


# ---------------------------------------------------------------- svg


PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777")


def svg_lines(
    series: Mapping[str, Sequence[tuple[float, float]]],
    *,
    width: int = 640,
    height: int = 160,
    unit: str = "",
) -> Safe:
    """A line per series of (x, y) points on shared axes, with a legend; an
    empty chart says so instead of drawing nothing."""
    points = [p for pts in series.values() for p in pts]
    if not points:
        return tag("p", "no samples yet", class_="muted")
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y1 = max(max(p[1] for p in points), 1e-9)
    pad = 30

    def xy(p: tuple[float, float]) -> str:
        x = pad + (p[0] - x0) / ((x1 - x0) or 1) * (width - 2 * pad)
        y = height - pad - p[1] / y1 * (height - 2 * pad)
        return f"{x:.1f},{y:.1f}"

    parts = [
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" '
        'stroke="#999"/>',
        f'<text x="2" y="{pad - 8}" font-size="10">{esc(f"{y1:.3g}{unit}")}</text>',
        f'<text x="2" y="{height - pad + 4}" font-size="10">0</text>',
    ]
    for i, (name, pts) in enumerate(series.items()):
        colour = PALETTE[i % len(PALETTE)]
        line = " ".join(xy(p) for p in pts)
        parts.append(
            f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{line}"/>'
        )
        parts.append(
            f'<text x="{pad + 150 * i}" y="{height - 6}" font-size="11" fill="{colour}">'
            f"{esc(name)}</text>"
        )
    return Safe(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img">{"".join(parts)}</svg>'
    )


def svg_bars(bars: Sequence[tuple[str, float]], *, width: int = 640, height: int = 140) -> Safe:
    """Vertical bars with their labels under them (a histogram's buckets)."""
    if not bars or max(v for _, v in bars) <= 0:
        return tag("p", "no observations yet", class_="muted")
    top = max(v for _, v in bars)
    step = (width - 20) / len(bars)
    parts = []
    for i, (label, v) in enumerate(bars):
        h = v / top * (height - 40)
        x = 10 + i * step
        parts.append(
            f'<rect x="{x:.1f}" y="{height - 25 - h:.1f}" width="{step * 0.8:.1f}" '
            f'height="{h:.1f}" fill="#2563eb"><title>{esc(f"{label}: {v:g}")}</title></rect>'
            f'<text x="{x:.1f}" y="{height - 10}" font-size="9">{esc(label)}</text>'
        )
    return Safe(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'role="img">{"".join(parts)}</svg>'
    )


# ---------------------------------------------------------------- the page

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#111}
header{background:#1f2937;color:#fff;padding:8px 16px;display:flex;gap:16px;align-items:center}
header a{color:#d1d5db;text-decoration:none}header a.on{color:#fff;font-weight:600}
header form{margin-left:auto}main{padding:16px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ddd;padding:3px 8px;
text-align:left;vertical-align:top}th{background:#f3f4f6}table.kv th{width:12em}
.badge{padding:1px 6px;border-radius:8px;font-size:12px;background:#e5e7eb}
.ok{background:#dcfce7}.warn{background:#fef3c7}.bad{background:#fee2e2}.info{background:#dbeafe}
.muted{color:#6b7280}.counts span{margin-right:12px}code{font-size:12px}
#live-hint{background:#fef3c7;padding:4px 8px;display:none}
form.filters input,form.filters select{margin-right:8px}
svg{border:1px solid #e5e7eb;display:block}
"""

NAV = (
    ("sandboxes", "/ui"),
    ("nodes", "/ui/nodes"),
    ("projects", "/ui/projects"),
    ("metrics", "/ui/metrics"),
)


def page(title: str, body: Safe, *, active: str = "", logout: bool = False) -> str:
    nav = join(link(path, name, class_="on" if name == active else None) for name, path in NAV)
    out = (
        Safe('<form method="post" action="/ui/logout"><button>log out</button></form>')
        if logout
        else Safe("")
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)} · Corral"
        f"</title><style>{STYLE}</style></head><body><header><strong>Corral</strong>"
        f"{nav}{out}</header><main><h1>{esc(title)}</h1>{body}</main></body></html>"
    )


def login_page(next_path: str, error: str = "") -> str:
    msg = tag("p", error, class_="bad", id="login-error") if error else Safe("")
    form = Safe(
        f'<form method="post" action="/ui/login" id="login">{msg}'
        f'<input type="hidden" name="next" value="{esc(next_path)}">'
        '<label>API key <input type="password" name="key" id="key" autofocus></label> '
        '<button type="submit" id="login-submit">log in</button></form>'
    )
    return page("Log in", form)
