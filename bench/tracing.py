"""What tracing costs: exec round trips with tracing unconfigured vs
configured (exporting to a real OTLP/HTTP receiver), in the same run.

    corral bench tracing [--execs 1000] [--quick]

Two `corral serve` nodes on this machine, each with one container sandbox:
one with no endpoint (tracing off: no SDK loaded, every span the shared
no-op), one with OTEL_EXPORTER_OTLP_ENDPOINT pointing at the receiver
tests/framework/otlp.py runs here (the same one the tests use; it decodes
every batch). Execs of `true` go to both in alternating blocks of 50, so
drift on the shared machine falls on both alike. Also the facade's own
cost per span, in this process, off and on.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from tests.framework.node import Node  # noqa: E402
from tests.framework.otlp import OtlpReceiver  # noqa: E402

from _common import IMAGE, IMAGES, fresh_dir, pct, table, write_result  # noqa: E402
from corral import trace  # noqa: E402
from corral.config import NodeConfig  # noqa: E402

WORK = Path("/var/lib/corral-bench-tracing")
BLOCK = 50


def _node(name: str, env: dict[str, str]) -> Node:
    cfg = NodeConfig.from_env(
        data_dir=WORK / name, images=IMAGES, node=name, scratch_size=4 * 2**30
    )
    fresh_dir(cfg.data_dir)
    return Node(cfg, sock=WORK / f"{name}.sock", serve_env=env)


def _span_cost(n: int) -> float:
    """Seconds per `with span(...)` plus one attribute, the best of five."""
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            with trace.span("sandbox.exec", **{"sandbox.id": "b-0123456789abcdef"}) as s:
                s.set("exec.exit_code", 0)
        best = min(best, (time.perf_counter() - t0) / n)
    return best


async def _execs(nodes: dict[str, Node], total: int) -> dict[str, list[float]]:
    clients = {k: n.http_client() for k, n in nodes.items()}
    times: dict[str, list[float]] = {k: [] for k in nodes}
    try:
        sbxs = {
            k: await c.sandboxes.create(image=IMAGE, memory="64MiB", cpu=0.5)
            for k, c in clients.items()
        }
        for s in sbxs.values():  # warm: connections, page cache
            for _ in range(20):
                await s.commands.run("true")
        while min(len(v) for v in times.values()) < total:
            for k, s in sbxs.items():
                for _ in range(BLOCK):
                    t0 = time.perf_counter()
                    r = await s.commands.run("true")
                    times[k].append(time.perf_counter() - t0)
                    assert r.exit_code == 0
        for s in sbxs.values():
            await s.close()
    finally:
        for c in clients.values():
            await c.aclose()
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--execs", type=int, default=1000)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    total = 200 if a.quick else a.execs
    for k in [k for k in os.environ if k.startswith("OTEL_")]:
        del os.environ[k]  # "off" must be off, whatever the shell had
    receiver = OtlpReceiver().start()
    fresh_dir(WORK)
    nodes = {
        "off": _node("troff", {}),
        "on": _node("tron", {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}),
    }
    try:
        for n in nodes.values():
            n.server.start()
        times = asyncio.run(_execs(nodes, total))
    finally:
        for n in nodes.values():
            n.close()
    spans = receiver.wait_for(lambda s: sum(x.name == "sandbox.exec" for x in s) >= total, 10)

    off_cost = _span_cost(200_000)
    trace.configure("corral-bench", receiver.url)
    on_cost = _span_cost(1_000)  # under the batch queue's 2,048: none dropped
    trace.shutdown()
    receiver.stop()

    ms = {k: [x * 1000 for x in v] for k, v in times.items()}
    base50, base99 = pct(ms["off"], 50), pct(ms["off"], 99)
    rows = []
    for k, label in (("off", "unconfigured (off)"), ("on", "OTLP endpoint configured")):
        p50, p99 = pct(ms[k], 50), pct(ms[k], 99)
        rows.append(
            [label, str(len(ms[k])), f"{p50:.2f}", f"{p99:.2f}",
             f"{p50 / base50:.2f}", f"{p99 / base99:.2f}"]
        )  # fmt: skip
    execs = sum(s.name == "sandbox.exec" for s in spans)
    sections = [
        "Two `corral serve` nodes on this machine, one container sandbox each "
        "(0.5 CPU, 64 MiB); `true` run over HTTP (unix socket, the SDK) in alternating "
        f"blocks of {BLOCK}, {total} per node, after 20 warm-up runs each. The traced node "
        "exports batches over OTLP/HTTP protobuf to a receiver in the benchmark's process "
        f"(tests/framework/otlp.py), which decoded {len(spans)} spans "
        f"({execs} `sandbox.exec`). Each exec on the traced node is two spans (the "
        "request's SERVER span and `sandbox.exec`), plus their encoding and export in "
        "the SDK's batch thread.",
        table(["tracing", "execs", "p50 (ms)", "p99 (ms)", "p50 vs off", "p99 vs off"], rows),
        "The machine is shared (2 cores, other work on it): p99 is mostly that work's noise "
        "and differs between runs in either direction; p50 is the comparison to read.",
        "The facade itself, per `with trace.span(...)` plus one attribute, in this process "
        "(best of five):\n\n"
        + table(
            ["tracing", "ns per span"],
            [
                ["off (the shared no-op)", f"{off_cost * 1e9:.0f}"],
                ["on (SDK span, batched)", f"{on_cost * 1e9:.0f}"],
            ],
        ),
    ]
    path = write_result("tracing", "Tracing: what it costs an exec", sections)
    print(path.read_text())


if __name__ == "__main__":
    main()
