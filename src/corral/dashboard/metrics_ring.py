"""/ui/metrics: the process's Prometheus registry, sampled into a ring.

Prometheus counters only say "so far"; the dashboard keeps its own small
history (a sample every INTERVAL seconds, the last KEEP of them: 30 min) so
the page can draw rates and latencies over time without a Prometheus
server. The ring lives in the serving process and starts empty with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from corral import metrics
from corral.dashboard.render import Safe, join, svg_bars, svg_lines, table, tag

INTERVAL = 5.0
KEEP = 360

# Creates that ended ready, on a node or through a gateway.
_CREATED = ("corral_sandboxes_created_total",)
_GATEWAY_CREATES = "corral_gateway_creates_total"
HISTOGRAMS = {
    "corral_sandbox_create_seconds": "create (node)",
    "corral_gateway_create_seconds": "create (gateway)",
    "corral_exec_seconds": "command",
    "corral_fncall_seconds": "function call",
}


@dataclass(frozen=True)
class Sample:
    at: float
    created: float
    failures: dict[str, float] = field(default_factory=dict)
    # histogram -> cumulative count per upper bound (summed over labels)
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)


def sample(registry: CollectorRegistry = metrics.REGISTRY, at: float | None = None) -> Sample:
    created = 0.0
    failures: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    for family in registry.collect():
        for s in family.samples:
            if s.name in _CREATED:
                created += s.value
            elif s.name == _GATEWAY_CREATES:
                outcome = s.labels.get("outcome", "")
                if outcome == "ready":
                    created += s.value
                elif outcome != "found":
                    failures[f"gateway: {outcome}"] = s.value
            elif s.name == "corral_sandbox_create_failures_total":
                failures[f"create: {s.labels.get('code', '?')}"] = s.value
            elif s.name == "corral_node_full_total":
                failures[f"node full: {s.labels.get('reason', '?')}"] = s.value
            elif s.name.endswith("_bucket") and s.name[: -len("_bucket")] in HISTOGRAMS:
                le = float(s.labels["le"])
                per = buckets.setdefault(s.name[: -len("_bucket")], {})
                per[le] = per.get(le, 0.0) + s.value
    return Sample(time.time() if at is None else at, created, failures, buckets)


def quantile(cumulative: dict[float, float], q: float) -> float | None:
    """The upper bound of the bucket holding quantile q (Prometheus'
    histogram_quantile without interpolation); None with no observations."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] <= 0:
        return None
    want = q * cumulative[bounds[-1]]
    for b in bounds:
        if cumulative[b] >= want:
            return b if b != float("inf") else bounds[-2] if len(bounds) > 1 else None
    return None


def _delta(a: dict[float, float], b: dict[float, float]) -> dict[float, float]:
    return {le: b[le] - a.get(le, 0.0) for le in b}


class Ring:
    def __init__(self, interval: float = INTERVAL, keep: int = KEEP) -> None:
        self.interval = interval
        self.samples: deque[Sample] = deque(maxlen=keep)
        self._task: asyncio.Task[None] | None = None

    def ensure_started(self) -> None:
        """Sampling starts with the first page served (the API's server runs
        without lifespan events to hang it on)."""
        if self._task is None or self._task.done():
            self.take()
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def take(self, s: Sample | None = None) -> Sample:
        s = s or sample()
        self.samples.append(s)
        return s

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            self.take()

    # ---------------------------------------------------------------- series

    def create_rate(self) -> list[tuple[float, float]]:
        return [
            (b.at, max(0.0, b.created - a.created) / max(b.at - a.at, 1e-9))
            for a, b in _pairs(self.samples)
        ]

    def failures(self) -> dict[str, list[tuple[float, float]]]:
        out: dict[str, list[tuple[float, float]]] = {}
        for a, b in _pairs(self.samples):
            for reason, n in b.failures.items():
                out.setdefault(reason, []).append((b.at, n - a.failures.get(reason, 0.0)))
        return out

    def latency(self, name: str) -> dict[str, list[tuple[float, float]]]:
        """p50 and p99 of what was observed between consecutive samples."""
        out: dict[str, list[tuple[float, float]]] = {"p50": [], "p99": []}
        for a, b in _pairs(self.samples):
            d = _delta(a.buckets.get(name, {}), b.buckets.get(name, {}))
            for label, q in (("p50", 0.5), ("p99", 0.99)):
                v = quantile(d, q)
                if v is not None:
                    out[label].append((b.at, v))
        return out


def _pairs(samples: Sequence[Sample]) -> Iterable[tuple[Sample, Sample]]:
    items = list(samples)
    return itertools.pairwise(items)


def _fmt_le(le: float) -> str:
    return "+Inf" if le == float("inf") else f"≤{le:g}s"


def metrics_page(ring: Ring) -> Safe:
    now = ring.take()  # the page shows what is true now, not 5 s ago
    span = now.at - ring.samples[0].at
    parts = [
        tag(
            "p",
            f"{len(ring.samples)} samples of this process's registry, every "
            f"{ring.interval:g} s, over the last {span / 60:.1f} min (kept: "
            f"{(ring.samples.maxlen or 0) * ring.interval / 60:g} min).",
            class_="muted",
            id="ring",
        ),
        tag("h2", "creates per second"),
        tag("p", f"{now.created:g} created since this process started", id="created"),
        svg_lines({"creates/s": ring.create_rate()}, unit="/s"),
        tag("h2", "failure reasons"),
    ]
    if now.failures:
        parts.append(table(("reason", "since start"), sorted(now.failures.items()), id="failures"))
        parts.append(svg_lines(ring.failures()))
    else:
        parts.append(tag("p", "no failures since this process started", id="failures"))
    parts.append(tag("h2", "latency"))
    for name, title in HISTOGRAMS.items():
        cumulative = now.buckets.get(name, {})
        if not cumulative or max(cumulative.values()) <= 0:
            continue
        bounds = sorted(cumulative)
        per = [
            (_fmt_le(le), cumulative[le] - (cumulative[bounds[i - 1]] if i else 0.0))
            for i, le in enumerate(bounds)
        ]
        p50, p99 = quantile(cumulative, 0.5), quantile(cumulative, 0.99)
        parts.append(
            tag("h3", f"{title}: p50 ≤ {p50:g} s, p99 ≤ {p99:g} s", data_histogram=name)
            if p50 is not None and p99 is not None
            else tag("h3", title)
        )
        parts.append(svg_bars(per))
        parts.append(svg_lines(ring.latency(name), unit=" s"))
    if not any(now.buckets.get(n) and max(now.buckets[n].values()) > 0 for n in HISTOGRAMS):
        parts.append(tag("p", "nothing observed yet", class_="muted"))
    return join(parts)
