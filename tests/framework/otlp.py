"""A real OTLP/HTTP trace receiver for the tests and bench/tracing.py: a
small HTTP server on a free port that accepts POST /v1/traces, decodes each
ExportTraceServiceRequest with opentelemetry-proto (what the exporter itself
encodes with) and keeps the spans, flattened."""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .processes import free_port


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    service: str
    trace_id: str  # hex
    span_id: str
    parent_id: str  # "" for a root span
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    attributes: dict[str, Any] = field(default_factory=dict)
    status: int = 0  # 2: error
    start_ns: int = 0
    end_ns: int = 0


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


def decode(body: bytes) -> list[ReceivedSpan]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    req = ExportTraceServiceRequest()
    req.ParseFromString(body)
    out = []
    for rs in req.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    ReceivedSpan(
                        name=s.name,
                        service=str(resource.get("service.name", "")),
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        kind=s.kind,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        status=s.status.code,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                    )
                )
    return out


class OtlpReceiver:
    def __init__(self) -> None:
        self.port = free_port()
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.requests = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                encoding = self.headers.get("content-encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                spans = decode(body)
                with receiver._lock:
                    receiver._spans += spans
                    receiver.requests += 1
                # An empty ExportTraceServiceResponse: full success.
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: the tests read spans, not access logs

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        """The base URL (OTEL_EXPORTER_OTLP_ENDPOINT): /v1/traces under it."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()

    def wait_for(
        self, done: Callable[[list[ReceivedSpan]], bool], timeout: float = 30.0
    ) -> list[ReceivedSpan]:
        """The spans once `done(spans)` holds; the spans so far at the timeout
        (the caller's assertions then say what is missing)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            if done(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.05)
