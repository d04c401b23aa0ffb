"""OpenTelemetry traces: off, and free, unless an OTLP endpoint is configured.

    with trace.span("sandbox.create", **{"sandbox.kind": kind}) as s:
        ...
        s.set("sandbox.id", sid)

`configure(service)` (called by `corral serve` and the gateway) turns
tracing on when it finds an endpoint: the argument (NodeConfig's
otlp_endpoint), else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT (the full URL),
else OTEL_EXPORTER_OTLP_ENDPOINT (+ /v1/traces). Spans then go, batched, to
that endpoint over OTLP/HTTP protobuf, as the resource `service`
(corral-node, corral-gateway). Until then nothing of OpenTelemetry's SDK or
exporter is imported by this module, and every call returns at its first
line: span() hands back one shared no-op object.

The tracer is this module's own provider's, not the global one, so that a
library that traces through the global provider (FastAPI does, natively)
is not switched on with it and the process's spans are exactly the ones
named here (docs/tracing.md). Context is OpenTelemetry's (contextvars): a
span made current in a coroutine is the parent of what that task, and the
tasks it starts, do next. Across processes it travels as W3C traceparent:
inject() on the client (api/transport.py), extract() on the server
(api/serving.py's RequestContext).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from types import SimpleNamespace, TracebackType
from typing import Any

# Set by configure() once an endpoint is found; None means off. `_otel`
# holds the OpenTelemetry modules and objects the live path uses.
_tracer: Any = None
_otel: Any = None


class NoSpan:
    """What every call returns while tracing is off: one shared object, so
    an untraced span costs a call and a return."""

    __slots__ = ()

    def __enter__(self) -> NoSpan:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        return None

    def set(self, key: str, value: object) -> None:
        pass

    def rename(self, name: str) -> None:
        pass

    def end(self, error: BaseException | None = None) -> None:
        pass


NOOP = NoSpan()


class LiveSpan(NoSpan):
    """An OpenTelemetry span. As a `with` block it ends at the block's end,
    marked failed by an exception out of it; `current` ones are also the
    parent of whatever runs inside the block."""

    __slots__ = ("_current", "_ended", "_span", "_token")

    def __init__(self, span: Any, current: bool) -> None:
        self._span = span
        self._current = current
        self._token: object = None
        self._ended = False

    def __enter__(self) -> LiveSpan:
        if self._current:
            self._token = _otel.context.attach(_otel.trace.set_span_in_context(self._span))
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.end(exc)
        if self._token is not None:
            _otel.context.detach(self._token)
            self._token = None

    def set(self, key: str, value: object) -> None:
        if value is not None:
            self._span.set_attribute(key, value)

    def rename(self, name: str) -> None:
        self._span.update_name(name)

    def end(self, error: BaseException | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        # A consumer that stops reading a stream early (GeneratorExit) did
        # not make the operation fail.
        if error is not None and not isinstance(error, GeneratorExit):
            code = getattr(error, "code", None)
            self._span.set_attribute("error.type", code or type(error).__name__)
            self._span.set_status(_otel.Status(_otel.StatusCode.ERROR, str(error)[:500]))
        self._span.end()

    @property
    def context(self) -> Any:
        return _otel.trace.set_span_in_context(self._span)


Span = NoSpan  # what callers hold: a NoSpan, or its LiveSpan subclass


def enabled() -> bool:
    return _tracer is not None


def _attrs(attrs: Mapping[str, object]) -> dict[str, object]:
    return {k: v for k, v in attrs.items() if v is not None}


def span(name: str, **attrs: object) -> Span:
    """A span, current inside its `with` block (in a coroutine: across its
    awaits; never across an async generator's yields, see start())."""
    if _tracer is None:
        return NOOP
    return LiveSpan(_tracer.start_span(name, attributes=_attrs(attrs)), current=True)


def start(name: str, **attrs: object) -> Span:
    """A child of the current span that is not made current: for an async
    generator, whose body runs in its consumer's context between yields
    (attaching there would leak into the consumer). End it with end()."""
    if _tracer is None:
        return NOOP
    return LiveSpan(_tracer.start_span(name, attributes=_attrs(attrs)), current=False)


def current() -> Span:
    """The current span, to add attributes to; NOOP if none or off."""
    if _tracer is None:
        return NOOP
    found = _otel.trace.get_current_span()
    return LiveSpan(found, current=False) if found.get_span_context().is_valid else NOOP


def record(name: str, start_ns: int, end_ns: int, **attrs: object) -> None:
    """A finished child of the current span, timed after the fact (epoch
    ns): a phase whose boundaries its caller already marks."""
    if _tracer is None:
        return
    s = _tracer.start_span(name, start_time=start_ns, attributes=_attrs(attrs))
    s.end(end_time=end_ns)


def client(name: str, headers: MutableMapping[str, str], **attrs: object) -> Span:
    """A CLIENT span for an outgoing request, its context injected into
    `headers` as traceparent: the server's span becomes its child. Not made
    current (its caller may be an async generator)."""
    if _tracer is None:
        return NOOP
    s = _tracer.start_span(name, kind=_otel.SpanKind.CLIENT, attributes=_attrs(attrs))
    live = LiveSpan(s, current=False)
    _otel.propagator.inject(headers, context=live.context)
    return live


def server(name: str, headers: Mapping[str, str], **attrs: object) -> Span:
    """A SERVER span continuing the trace whose traceparent `headers`
    carry (a new trace without one), current inside its block."""
    if _tracer is None:
        return NOOP
    parent = _otel.propagator.extract(headers)
    s = _tracer.start_span(
        name, context=parent, kind=_otel.SpanKind.SERVER, attributes=_attrs(attrs)
    )
    return LiveSpan(s, current=True)


def inject(headers: MutableMapping[str, str]) -> None:
    """The current span's context into `headers` (traceparent, tracestate)."""
    if _tracer is not None:
        _otel.propagator.inject(headers)


def ids() -> tuple[str, str] | None:
    """(trace_id, span_id) of the current span, in hex, for log lines."""
    if _tracer is None:
        return None
    ctx = _otel.trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"


def endpoint_from_env(given: str | None = None) -> str | None:
    """The OTLP/HTTP traces URL configured, if any (see the module's doc)."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return None
    if given:
        return given if given.rstrip("/").endswith("/v1/traces") else _traces_url(given)
    if full := env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return full
    if base := env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        return _traces_url(base)
    return None


def _traces_url(base: str) -> str:
    return base.rstrip("/") + "/v1/traces"


def configure(service: str, endpoint: str | None = None) -> bool:
    """Turn tracing on as `service` if an endpoint is configured; True if on.
    Without the `otel` extra installed, a configured endpoint is reported
    (a warning) and tracing stays off: the server still serves."""
    global _tracer, _otel
    url = endpoint_from_env(endpoint)
    if url is None or _tracer is not None:
        return _tracer is not None
    try:
        from opentelemetry import context, trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    except ImportError as exc:
        import logging

        logging.getLogger("corral.trace").warning(
            "tracing is configured (%s) but OpenTelemetry is not installed "
            "(pip install 'corral[otel]'): %s",
            url,
            exc,
        )
        return False
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))

    _otel = SimpleNamespace(
        context=context,
        trace=trace,
        SpanKind=SpanKind,
        Status=Status,
        StatusCode=StatusCode,
        propagator=TraceContextTextMapPropagator(),
        provider=provider,
    )
    _tracer = provider.get_tracer("corral")
    return True


def shutdown() -> None:
    """Export what is batched and turn tracing off (a server's exit)."""
    global _tracer, _otel
    if _otel is not None:
        _otel.provider.shutdown()
    _tracer = _otel = None
