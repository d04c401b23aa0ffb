"""The connection under HttpService (api/http.py, generated from the route
table): one httpx client per service, errors rebuilt from their wire code,
a command's events read from its NDJSON stream.

URLs: ``http://host:7070`` or ``unix:/path/to/corral.sock``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx

from corral import trace
from corral.api.models import Event, ExecEvent, ExecExit
from corral.api.wire import read_event
from corral.errors import CorralError, InternalError, Unavailable, error_from_wire

# What httpx takes as a query: (name, value) pairs, a name may repeat.
QueryPairs = list[tuple[str, str | int | float | bool | None]]


def _error(resp: httpx.Response, body: bytes) -> CorralError:
    try:
        doc = json.loads(body)
        return error_from_wire(doc["error"], resp.status_code)
    except (ValueError, KeyError, TypeError):
        text = body[:300].decode(errors="replace")
        return InternalError(f"HTTP {resp.status_code} from {resp.url}: {text}")


def _client_span(method: str, path: str, url: str, headers: dict[str, str]) -> trace.Span:
    """With tracing on (a gateway's hop to a node), the call is a CLIENT span
    whose traceparent (put in `headers`) the server continues; off, NOOP
    before any attribute is built."""
    if not trace.enabled():
        return trace.NOOP
    attrs = {"http.request.method": method, "url.path": path, "server.address": url}
    return trace.client(method, headers, **attrs)


class HttpTransport:
    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`transport` replaces the network (tests pass httpx.ASGITransport)."""
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        base = url.rstrip("/")
        if transport is None and url.startswith("unix:"):
            transport = httpx.AsyncHTTPTransport(uds=url.removeprefix("unix:"))
            base = "http://corral"
        self.url = url
        self._adopted: list[HttpTransport] = []
        self._http = httpx.AsyncClient(
            base_url=base,
            transport=transport or httpx.AsyncHTTPTransport(),
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=10.0),
        )

    async def start(self) -> None:
        """Nothing to start: connections open on first use."""

    async def aclose(self) -> None:
        for child in self._adopted:
            await child.aclose()
        self._adopted.clear()
        await self._http.aclose()

    def adopt(self, child: HttpTransport) -> None:
        """Close `child` with this one (a direct path's transport, opened
        from this client's sandboxes)."""
        self._adopted.append(child)

    def _unreachable(self, exc: httpx.TransportError) -> Unavailable:
        return Unavailable(f"Corral server at {self.url} unreachable: {exc}", retry=True)

    async def _send(
        self,
        method: str,
        path: str,
        *,
        params: QueryPairs | None = None,
        json_body: str | None = None,
        raw_body: bytes | None = None,
    ) -> httpx.Response:
        """One request; an error status raises the error it carries."""
        headers = {"content-type": "application/json"} if json_body is not None else {}
        with _client_span(method, path, self.url, headers) as span:
            try:
                resp = await self._http.request(
                    method,
                    path,
                    params=params,
                    content=json_body if json_body is not None else raw_body,
                    headers=headers,
                )
            except httpx.TransportError as exc:
                raise self._unreachable(exc) from exc
            span.set("http.response.status_code", resp.status_code)
            if resp.status_code >= 400:
                raise _error(resp, resp.content)
            return resp

    async def _events(self, method: str, path: str, json_body: str) -> AsyncIterator[ExecEvent]:
        """A command's events, as they arrive (no read timeout: a command
        may be silent for as long as its own timeout allows)."""
        headers = {"content-type": "application/json"}
        span = _client_span(method, path, self.url, headers)  # ended below, never current
        error: BaseException | None = None
        try:
            async with self._http.stream(
                method,
                path,
                content=json_body,
                headers=headers,
                timeout=httpx.Timeout(None, connect=10.0),
            ) as resp:
                span.set("http.response.status_code", resp.status_code)
                if resp.status_code >= 400:
                    raise _error(resp, await resp.aread())
                async for line in resp.aiter_lines():
                    event = read_event(line)
                    if event is None:
                        continue
                    yield event
                    if isinstance(event, ExecExit):
                        return
        except httpx.TransportError as exc:
            error = self._unreachable(exc)
            raise error from exc
        except BaseException as exc:
            error = exc
            raise
        finally:
            span.end(error)

    async def _sse(self, path: str, params: QueryPairs) -> AsyncIterator[Event]:
        """Server-sent events as they arrive (no read timeout: a quiet node
        sends a comment line now and then), until the caller stops."""
        try:
            async with self._http.stream(
                "GET",
                path,
                params=params,
                headers={"accept": "text/event-stream"},
                timeout=httpx.Timeout(None, connect=10.0),
            ) as resp:
                if resp.status_code >= 400:
                    raise _error(resp, await resp.aread())
                kind = ""
                async for line in resp.aiter_lines():
                    if line.startswith("event:"):
                        kind = line[6:].strip()
                    elif line.startswith("data:"):
                        if kind == "error":  # the stream's last word (api/serving.py)
                            raise error_from_wire(json.loads(line[5:])["error"])
                        yield Event.model_validate_json(line[5:])
                    elif not line:
                        kind = ""
        except httpx.TransportError as exc:
            raise self._unreachable(exc) from exc
