"""Creates whose client went away before the answer.

A client that gives up on a create over HTTP (its timeout, its task
cancelled) closes the connection, but the create goes on in the node: the
handler is not cancelled, and the sandbox it makes is answered to nobody.
It would hold its slot until its TTL. Here the create's connection is
watched while the node works; if the client is gone before the answer
starts, the sandbox the answer names is closed. A create with an
idempotency key is left alone: its client may retry with that key and get
this very sandbox.

Only the two create routes pass through here (Corral's and E2B's). Their
bodies are small (capped by the route table) and read whole first, so the
watcher can then wait on the connection without racing the app for the
body.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from corral.api.service import SandboxService
from corral.errors import CorralError
from corral.log import get_logger

log = get_logger("corral.api")

# Route -> the answer's field that names the sandbox made.
CREATES = {"/v1/sandboxes": "id", "/sandboxes": "sandboxID"}
BODY_CAP = 1 << 20  # what a create's body may be (bigger ones go through unwatched)


class AbandonedCreates:
    def __init__(
        self, app: ASGIApp, resolve: Callable[[Request], Awaitable[SandboxService]]
    ) -> None:
        self.app = app
        self.resolve = resolve

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        field = CREATES.get(scope.get("path", "")) if scope["type"] == "http" else None
        if field is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        pending: list[Message] = []
        size = 0
        while True:
            message = await receive()
            pending.append(message)
            if message["type"] != "http.request":
                break  # the client left while sending
            size += len(message.get("body", b""))
            if not message.get("more_body") or size > BODY_CAP:
                break
        if pending[-1].get("more_body"):  # too big for a create: not watched
            await self.app(scope, _replaying(pending, receive), send)
            return
        body = b"".join(m.get("body", b"") for m in pending if m["type"] == "http.request")
        gone = asyncio.Event()  # set if the client left before the answer began
        started = False
        answer: list[bytes] = []

        async def replay() -> Message:
            if pending:
                return pending.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not started:
                gone.set()

        async def send_watched(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and sum(map(len, answer)) < BODY_CAP:
                answer.append(message.get("body", b""))
            await send(message)

        watcher = asyncio.create_task(watch())
        try:
            await self.app(scope, replay, send_watched)
        finally:
            watcher.cancel()
        if gone.is_set() and not _keyed(body):
            await self._close(scope, b"".join(answer), field)

    async def _close(self, scope: Scope, answer: bytes, field: str) -> None:
        try:
            sandbox_id = json.loads(answer).get(field)
        except (ValueError, AttributeError):
            return  # not an answer that names a sandbox: nothing was made
        if not isinstance(sandbox_id, str):
            return
        try:
            svc = await self.resolve(Request(scope))
            await svc.close(sandbox_id)
        except CorralError as exc:
            log.warning("api.abandoned_close_failed", sandbox=sandbox_id, error=exc.message)
            return
        except Exception as exc:  # the answer is sent: nothing must escape to the server
            log.error("api.abandoned_close_failed", sandbox=sandbox_id, error=str(exc), exc=True)
            return
        log.info("api.abandoned_create_closed", sandbox=sandbox_id)


def _keyed(body: bytes) -> bool:
    """Whether the create carries an idempotency key (a retry gets it)."""
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("idempotency_key") is not None


def _replaying(pending: list[Message], receive: Receive) -> Receive:
    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay
