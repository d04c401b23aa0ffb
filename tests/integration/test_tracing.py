"""OpenTelemetry traces from real processes (docs/tracing.md): a `corral
serve` node configured with OTEL_EXPORTER_OTLP_ENDPOINT sends a create's
and an exec's spans to a real OTLP/HTTP receiver run by the test
(tests/framework/otlp.py); through a gateway, a create is one trace across
the gateway's process and the node's."""

from __future__ import annotations

import itertools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from corral.config import NodeConfig

from ..framework import IMAGE, Cluster, Node, run_sync
from ..framework.otlp import OtlpReceiver, ReceivedSpan

SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind
ERROR = 2  # Status.StatusCode
PHASES = {"create.admit", "create.prepare", "create.start", "create.ready"}
# Spans are batched; exported every 100 ms here instead of every 5 s.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver().start()
    yield r
    r.stop()


def _one(spans: list[ReceivedSpan], name: str, **where: object) -> ReceivedSpan:
    found = [
        s
        for s in spans
        if s.name == name and all(s.attributes.get(k) == v for k, v in where.items())
    ]
    assert len(found) == 1, (name, where, sorted(s.name for s in spans))
    return found[0]


def _children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> dict[str, ReceivedSpan]:
    return {s.name: s for s in spans if s.parent_id == parent.span_id}


async def test_a_nodes_create_and_exec_arrive_as_spans(
    fresh_config: NodeConfig, receiver: OtlpReceiver
) -> None:
    node = Node(
        fresh_config, serve_env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, **FAST_EXPORT}
    )
    try:
        node.server.start()
        async with node.http_client() as c:
            sbx = await c.sandboxes.create(image=IMAGE, memory="128MiB")
            r = await sbx.commands.run("echo hi; exit 3")
            assert (r.exit_code, r.stdout) == (3, "hi\n")
            await sbx.close()
        sid = sbx.id

        def arrived(spans: list[ReceivedSpan]) -> bool:
            names = {s.name for s in spans}
            return {"sandbox.create", "sandbox.exec", "DELETE /v1/sandboxes/{sandbox_id}"} <= (
                names
            )

        spans = receiver.wait_for(arrived)
    finally:
        node.close()
    assert {s.service for s in spans} == {"corral-node"}

    # The create: the request's SERVER span, sandbox.create under it, and
    # the lifecycle's phases under that, in order, inside its interval.
    post = _one(spans, "POST /v1/sandboxes")
    assert post.kind == SERVER and post.attributes["http.response.status_code"] == 201
    create = _one(spans, "sandbox.create")
    assert create.parent_id == post.span_id and create.trace_id == post.trace_id
    assert create.attributes["sandbox.id"] == sid
    assert create.attributes["sandbox.kind"] == "container"
    phases = _children(spans, create)
    assert set(phases) >= PHASES, sorted(phases)
    ordered = sorted(phases.values(), key=lambda s: s.start_ns)
    assert [s.name for s in ordered][:4] == [
        "create.admit", "create.prepare", "create.start", "create.ready",
    ]  # fmt: skip
    for p in ordered:
        assert create.start_ns <= p.start_ns <= p.end_ns <= create.end_ns, p.name
    for a, b in itertools.pairwise(ordered):
        assert a.end_ns == b.start_ns  # one boundary each, as the log's ms fields

    # The exec: request to exit, with the exit code, under its request's span.
    ex = _one(spans, "sandbox.exec")
    assert ex.attributes["sandbox.id"] == sid and ex.attributes["exec.exit_code"] == 3
    assert ex.attributes["exec.outcome"] == "ok" and ex.status != ERROR
    req = _one(spans, "POST /v1/sandboxes/{sandbox_id}/exec")
    assert ex.parent_id == req.span_id and req.attributes["sandbox.id"] == sid
    # Each request is its own trace (the SDK sent no traceparent).
    assert req.trace_id != post.trace_id


def test_an_unconfigured_node_sends_nothing(
    fresh_config: NodeConfig, receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The control for the test above: the same node, no endpoint, and the
    # receiver hears nothing (so the spans above came from configuring it).
    for k in [k for k in os.environ if k.startswith("OTEL_")]:
        monkeypatch.delenv(k)

    node = Node(fresh_config, serve_env=FAST_EXPORT)
    try:
        node.server.start()

        async def go() -> None:
            async with node.http_client() as c:
                sbx = await c.sandboxes.create(image=IMAGE, memory="128MiB")
                await sbx.commands.run("true")
                await sbx.close()

        run_sync(go())
        spans = receiver.wait_for(lambda s: bool(s), timeout=1.0)
    finally:
        node.close()
    assert spans == [] and receiver.requests == 0


@pytest.mark.slow
@pytest.mark.requires_postgres
async def test_a_create_through_the_gateway_is_one_trace(
    data_root: Path, receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The gateway and the node inherit this environment (tests/framework).
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    for k, v in FAST_EXPORT.items():
        monkeypatch.setenv(k, v)
    cluster = Cluster(data_root / "tr", nodes=1, node_timeout=3.0)
    try:
        cluster.start()
        key = cluster.project("traced")
        async with cluster.client(key) as c:
            sbx = await c.sandboxes.create(image=IMAGE, memory="128MiB")
            assert (await sbx.commands.run("exit 5")).exit_code == 5
            await sbx.close()

        def arrived(spans: list[ReceivedSpan]) -> bool:
            names = {(s.service, s.name) for s in spans}
            # Every span asserted on below: a server span ends (and is
            # exported) after its children, a streamed one after its stream,
            # in a later batch (CI once read them between the two).
            return {
                ("corral-gateway", "gateway.create"),
                ("corral-gateway", "POST /v1/sandboxes"),
                ("corral-node", "POST /v1/sandboxes"),
                ("corral-node", "sandbox.create"),
                ("corral-node", "sandbox.exec"),
                ("corral-gateway", "POST /v1/sandboxes/{sandbox_id}/exec"),
                ("corral-node", "POST /v1/sandboxes/{sandbox_id}/exec"),
            } <= names

        spans = receiver.wait_for(arrived)
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)

    gw_create = _one(spans, "gateway.create")
    assert gw_create.service == "corral-gateway"
    assert gw_create.attributes["corral.project"] == "traced"
    assert gw_create.attributes["sandbox.id"] == sbx.id
    trace = [s for s in spans if s.trace_id == gw_create.trace_id]
    by_id = {s.span_id: s for s in trace}

    # gateway: POST /v1/sandboxes (SERVER) > gateway.create > gateway.place,
    # and > the CLIENT hop to the node; node: its SERVER span under that hop,
    # sandbox.create under it, the phases under that.
    gw_post = by_id[gw_create.parent_id]
    assert (gw_post.name, gw_post.kind, gw_post.service) == (
        "POST /v1/sandboxes", SERVER, "corral-gateway",
    )  # fmt: skip
    below = _children(trace, gw_create)
    assert "gateway.place" in below and below["gateway.place"].attributes["node"] == "k0"
    hop = below["POST"]
    assert hop.kind == CLIENT and hop.service == "corral-gateway"
    (node_post,) = [s for s in trace if s.parent_id == hop.span_id]
    assert (node_post.name, node_post.kind, node_post.service) == (
        "POST /v1/sandboxes", SERVER, "corral-node",
    )  # fmt: skip
    node_create = _one(trace, "sandbox.create")
    assert node_create.parent_id == node_post.span_id
    assert node_create.attributes["sandbox.id"] == sbx.id
    assert set(_children(trace, node_create)) >= PHASES

    # The exec through the gateway: its own trace, across both processes too.
    ex = _one(spans, "sandbox.exec")
    assert ex.attributes["exec.exit_code"] == 5
    ex_trace = {(s.service, s.name) for s in spans if s.trace_id == ex.trace_id}
    assert {
        ("corral-gateway", "POST /v1/sandboxes/{sandbox_id}/exec"),
        ("corral-gateway", "POST"),
        ("corral-node", "POST /v1/sandboxes/{sandbox_id}/exec"),
    } <= ex_trace, ex_trace
