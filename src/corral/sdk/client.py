"""The asynchronous client: the source of truth of Corral's SDK.

    async with corral.AsyncClient() as client:            # embedded node
        sbx = await client.sandboxes.create(image="debian-python:bookworm")
        r = await sbx.commands.run("python3 -V")

`AsyncClient()` runs a node agent in this process (root needed), sharing its
node with any other process using the same data dir; `AsyncClient(url)`
talks to `corral serve` or a gateway; `AsyncClient(transport=service)` uses
any SandboxService given (a test's fake, an embedder's own). All behave
the same, errors included.
"""

from __future__ import annotations

import asyncio
import builtins
import inspect
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.api.models import (
    CreateSandbox,
    ForkRequest,
    NetworkPolicy,
    SandboxInfo,
    SavedState,
    validated,
)
from corral.api.service import SandboxService
from corral.config import NodeConfig
from corral.errors import CorralError, InvalidArgument, Unavailable
from corral.sdk.events import AsyncEventStream, open_stream
from corral.sdk.fncall import AsyncFnCall
from corral.sdk.keys import AsyncKeys
from corral.sdk.request import create_request as _create_request
from corral.sdk.rollouts import AsyncRollouts
from corral.sdk.sandbox import AsyncSandbox


@dataclass(frozen=True)
class BulkOutcome:
    """One sandbox's outcome in a bulk call: its info after, or the error."""

    id: str
    info: SandboxInfo | None
    error: CorralError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class AsyncSandboxes:
    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(
        self,
        *,
        kind: str = "container",
        image: str,
        workspace: str | None = None,
        toolkit: str | list[str] | None = None,
        cpu: float | None = None,
        memory: int | str | None = None,
        disk: int | str = "2GiB",
        pids: int = 512,
        ttl: float | None = 3600,
        idle_timeout: float | None = 600,
        on_expiry: str = "close",
        env: dict[str, str] | None = None,
        labels: dict[str, str] | None = None,
        network: NetworkPolicy | dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        display_size: str | tuple[int, int] | None = None,
        protected: list[str] | None = None,
        cpu_class: str = "interactive",
        firmware: str | None = None,
    ) -> AsyncSandbox:
        """Create a sandbox and return once it accepts commands.

        The root file system is the image with the workspace and toolkit
        layers composed over it (toolkits in the order given, the last on
        top) and a private writable layer of at most `disk` bytes. With no
        `network` policy the sandbox has loopback only; with one, it may reach
        what the policy allows (NetworkPolicy: domains, cidrs, ports,
        ecosystems) and nothing else. A create retried with the same
        `idempotency_key` returns the sandbox the first attempt made.
        `cpu` and `memory` default to 1 core and 1 GiB; a `fullvm` gets 2
        cores, 2 GiB and a `display_size` of 1024x768 unless given.
        `protected` paths (the task's tests) are watched from the start: a
        write to one is a violation in the sandbox's report (audit()).
        `on_expiry` "suspend" (or "disk": its memory given back) suspends
        the sandbox when its `ttl` ends instead of closing it; it then has
        no TTL until set_ttl() (docs/node.md).
        `cpu_class` "background" makes its commands yield the CPU to
        interactive sandboxes' (docs/cpu-classes.md). A `fullvm` whose
        image is "disk:NAME" boots a disk added to the node (`corral disk
        add`) with `firmware` "bios" (default) or "uefi", and returns once
        its screen is drawn and still (docs/own-disk.md)."""
        req = _create_request(
            kind=kind,
            image=image,
            workspace=workspace,
            toolkit=toolkit,
            cpu=cpu,
            memory=memory,
            disk=disk,
            pids=pids,
            ttl=ttl,
            idle_timeout=idle_timeout,
            on_expiry=on_expiry,
            env=env,
            labels=labels,
            network=network,
            display_size=display_size,
            protected=protected,
            cpu_class=cpu_class,
            firmware=firmware,
        )
        if idempotency_key is not None:
            req = validated(CreateSandbox, {**req.model_dump(), "idempotency_key": idempotency_key})
        service = await self._client._ready()
        return AsyncSandbox(service, await service.create(req))

    async def create_many(
        self,
        spec: dict[str, Any],
        count: int,
        *,
        concurrency: int = 32,
        key: str | None = None,
        on_ready: Callable[[int, str | CorralError], object] | None = None,
        retry_for: float = 30.0,
    ) -> builtins.list[AsyncSandbox | CorralError]:
        """Create `count` sandboxes from one spec (create()'s keyword
        arguments), at most `concurrency` at a time. Item i's result is its
        sandbox, or the error that stopped it: one failure does not stop
        the others. `on_ready(i, id_or_error)` is called as each finishes.

        Each item carries the idempotency key `<key>-<i>`: calling again
        with the same `key` (after a timeout, a lost connection, a crash)
        returns the sandboxes already made instead of making more. Without
        a `key` one is drawn at random, so only passing one makes a retry
        safe. An item refused as Unavailable with ``retry`` set (the server
        or its state store briefly unreachable) is retried under its key
        until `retry_for` seconds after the burst began; after that, it is
        reported as failed."""
        if not 1 <= count <= 100_000:
            raise InvalidArgument("count", "must be between 1 and 100000", count)
        if concurrency < 1:
            raise InvalidArgument("concurrency", "must be at least 1", concurrency)
        if not 0 <= retry_for <= 3600:
            raise InvalidArgument("retry_for", "must be between 0 and 3600 seconds", retry_for)
        unknown = sorted(set(spec) - set(inspect.signature(_create_request).parameters))
        if unknown:
            raise InvalidArgument(f"spec.{unknown[0]}", "is not a known field", spec[unknown[0]])
        if "image" not in spec:
            raise InvalidArgument("spec.image", "is required", None)
        base = _create_request(**spec)
        key = key or secrets.token_hex(8)
        if not re.fullmatch(r"[A-Za-z0-9._:-]{1,100}", key):
            raise InvalidArgument("key", "must be 1-100 letters, digits and . _ : -", key)
        service = await self._client._ready()
        gate = asyncio.Semaphore(concurrency)
        results: builtins.list[AsyncSandbox | CorralError | None] = [None] * count
        # One deadline for the whole burst: a server that stays down costs
        # `retry_for` once, not once per item.
        deadline = time.monotonic() + retry_for

        async def one(i: int) -> None:
            req = base.model_copy(update={"idempotency_key": f"{key}-{i}"})
            async with gate:
                out: AsyncSandbox | CorralError
                pause = 0.1
                while True:
                    try:
                        out = AsyncSandbox(service, await service.create(req))
                    except Unavailable as exc:
                        # The item's key makes a retry return what the lost
                        # attempt made, so an outage (a server or its state
                        # store restarting) costs time, not duplicates.
                        if exc.details.get("retry") and time.monotonic() + pause < deadline:
                            await asyncio.sleep(pause)
                            pause = min(pause * 2, 2.0)
                            continue
                        out = exc
                    except CorralError as exc:
                        out = exc
                    break
            results[i] = out
            if on_ready is not None:
                on_ready(i, out.id if isinstance(out, AsyncSandbox) else out)

        await asyncio.gather(*(one(i) for i in range(count)))
        return [r for r in results if r is not None]

    async def suspend_many(
        self,
        labels: dict[str, str],
        *,
        mode: str | None = None,
        concurrency: int = 64,
        key: str | None = None,
    ) -> builtins.list[BulkOutcome]:
        """Suspend every live sandbox carrying all of `labels` (a training
        job's preemption hook), at most `concurrency` at a time; one
        outcome per sandbox, a failure not stopping the others. With
        `key`, calling again (the hook retried after a crash) suspends no
        sandbox a call with that key already suspended, even one resumed
        since."""
        return await self._many(labels, concurrency, lambda s: s.suspend(mode, key=key))

    async def resume_many(
        self, labels: dict[str, str], *, concurrency: int = 64
    ) -> builtins.list[BulkOutcome]:
        """Resume every suspended sandbox carrying all of `labels` (running
        ones are left as they are); one outcome per sandbox."""
        return await self._many(labels, concurrency, lambda s: s.resume())

    async def _many(
        self,
        labels: dict[str, str],
        concurrency: int,
        act: Callable[[AsyncSandbox], Awaitable[SandboxInfo]],
    ) -> builtins.list[BulkOutcome]:
        if not labels:
            raise InvalidArgument("labels", "must name at least one label (not every sandbox)", {})
        if concurrency < 1:
            raise InvalidArgument("concurrency", "must be at least 1", concurrency)
        gate = asyncio.Semaphore(concurrency)

        async def one(sbx: AsyncSandbox) -> BulkOutcome:
            async with gate:
                try:
                    return BulkOutcome(sbx.id, await act(sbx))
                except CorralError as exc:
                    return BulkOutcome(sbx.id, None, exc)

        return list(await asyncio.gather(*(one(s) for s in await self.list(labels))))

    async def fork(
        self, sandbox: AsyncSandbox | str, n: int, *, idempotency_key: str | None = None
    ) -> builtins.list[AsyncSandbox]:
        """`n` new sandboxes, each a copy of a running sandbox as it is now
        (memory, processes, files), on its node: a VM, or a container (with
        CRIU; no command may be running in it). The source pauses for the
        save (~0.1 s per 256 MiB) and runs on. All or nothing. With
        `idempotency_key`, a retried fork returns the copies the first made.
        Copies are labelled corral.forked_from=<source id>."""
        sandbox_id = sandbox if isinstance(sandbox, str) else sandbox.id
        keys = [f"{idempotency_key}.{i}" for i in range(n)] if idempotency_key else None
        req = validated(ForkRequest, {"n": n, "idempotency_keys": keys})
        service = await self._client._ready()
        return [AsyncSandbox(service, info) for info in await service.fork(sandbox_id, req)]

    async def restore(
        self, saved: SavedState | dict[str, Any], *, idempotency_key: str | None = None
    ) -> AsyncSandbox:
        """A new sandbox from a state sbx.save() put in an object store: its
        memory, processes and files as they were saved, on this client's
        node (or, through a gateway, on any node). Labelled
        corral.restored_from=<the saved sandbox's id>."""
        fields = saved.model_dump() if isinstance(saved, SavedState) else dict(saved)
        if idempotency_key is not None:
            fields["idempotency_key"] = idempotency_key
        req = validated(SavedState, fields)
        service = await self._client._ready()
        return AsyncSandbox(service, await service.restore(req))

    async def get(self, sandbox_id: str) -> AsyncSandbox:
        """Re-attach to a sandbox by id (from any process)."""
        service = await self._client._ready()
        return AsyncSandbox(service, await service.get(sandbox_id))

    async def list(self, labels: dict[str, str] | None = None) -> builtins.list[AsyncSandbox]:
        """Live sandboxes, optionally those carrying all the given labels."""
        service = await self._client._ready()
        return [AsyncSandbox(service, info) for info in await service.list(labels)]


class AsyncClient:
    def __init__(
        self,
        url: str | None = None,
        *,
        api_key: str | None = None,
        data_dir: str | Path | None = None,
        node: str | None = None,
        config: NodeConfig | None = None,
        timeout: float = 600.0,
        transport: SandboxService | None = None,
    ) -> None:
        """`transport`, if given, is the service this client uses (it starts
        and closes it); the other arguments then go unused."""
        self.url = url
        self._service: SandboxService
        self._started = False
        # The service's one start, shared by concurrent first calls (a
        # trainer's environments all resetting at once): started twice, an
        # embedded node would run a second set of parts that no close stops.
        self._starting: asyncio.Future[object] | None = None
        if transport is not None:
            self._service = transport
        elif url:
            # Imported here: an embedded client needs no HTTP stack, and a
            # remote one no node agent.
            from corral.api.http import HttpService

            self._service = HttpService(url, api_key=api_key, timeout=timeout)
        else:
            from corral.node.agent import NodeAgent

            cfg = config or NodeConfig.from_env(data_dir=data_dir, node=node)
            self._service = NodeAgent(cfg)
        self.sandboxes = AsyncSandboxes(self)
        self.rollouts = AsyncRollouts(self._ready)
        self.fncall = AsyncFnCall(self._ready)
        self.keys = AsyncKeys(self._ready)

    @property
    def service(self) -> SandboxService:
        return self._service

    async def _ready(self) -> SandboxService:
        if not self._started:
            if self._starting is None:
                self._starting = asyncio.ensure_future(self._service.start())
            starting = self._starting
            try:
                # A caller cancelled while it waits leaves the start running
                # for the others.
                await asyncio.shield(starting)
            except BaseException:
                if starting.done() and self._starting is starting:
                    self._starting = None  # failed: the next call tries again
                raise
            self._started = True
        return self._service

    async def open(self) -> AsyncClient:
        await self._ready()
        return self

    async def events(self, labels: dict[str, str] | None = None) -> AsyncEventStream:
        """What happens from now on to sandboxes carrying all of `labels`
        (state changes, command ends, findings): live when this returns."""
        return await open_stream(await self._ready(), labels)

    async def aclose(self) -> None:
        """Stop this client. Sandboxes live on (until their TTL): close them,
        or re-attach from another client with sandboxes.get(id)."""
        starting, self._starting = self._starting, None
        if starting is not None and not self._started:
            # A start still under way finishes, then is closed with the rest.
            (result,) = await asyncio.gather(starting, return_exceptions=True)
            self._started = not isinstance(result, BaseException)
        if self._started:
            await self._service.aclose()
            self._started = False

    async def __aenter__(self) -> AsyncClient:
        return await self.open()

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
