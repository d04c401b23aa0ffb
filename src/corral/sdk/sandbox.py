"""A handle on one sandbox, keyed by id: any process can re-attach to it."""

from __future__ import annotations

from corral.api.models import (
    AuditReport,
    CommitRequest,
    LayerInfo,
    ProtectRequest,
    SandboxInfo,
    SavedState,
    SaveRequest,
    Usage,
    validated,
)
from corral.api.service import SandboxService
from corral.api.verdict import Rules
from corral.sdk.commands import AsyncCommands
from corral.sdk.display import AsyncDisplay
from corral.sdk.files import AsyncFiles
from corral.sdk.network import AsyncNetwork


class AsyncSandbox:
    def __init__(self, service: SandboxService, info: SandboxInfo) -> None:
        self._service = service
        self.info = info
        self.commands = AsyncCommands(self)
        self.files = AsyncFiles(self)
        self.network = AsyncNetwork(self)
        self.display = AsyncDisplay(self)

    @property
    def id(self) -> str:
        return self.info.id

    def __repr__(self) -> str:
        return f"<AsyncSandbox {self.id} {self.info.kind} {self.info.state.value}>"

    async def refresh(self) -> SandboxInfo:
        self.info = await self._service.get(self.id)
        return self.info

    async def commit(
        self,
        tag: str,
        *,
        kind: str = "layer",
        labels: dict[str, str] | None = None,
        stack: bool = False,
        env: list[str] | None = None,
        workdir: str | None = None,
        user: str | None = None,
    ) -> LayerInfo:
        """Save what this sandbox changed over its image as a new layer
        `tag` (kind: base, workspace, toolkit or layer); the sandbox runs on.
        `labels` are the layer's own (not corral.*). With `stack`, the layer
        is an image of its own: the sandbox's image with this layer on top
        (the sandbox must have no workspace or toolkit), `env`, `workdir`
        and `user` its config."""
        req = validated(
            CommitRequest,
            {"tag": tag, "kind": kind, "labels": labels or {}, "stack": stack,
             "env": env or [], "workdir": workdir, "user": user},
        )  # fmt: skip
        return await self._service.commit(self.id, req)

    async def audit(self, rules: Rules | None = None) -> AuditReport:
        """What this sandbox was refused, hit or had killed (also after it
        closed): denied syscalls by class and name, OOM kills, pids-limit
        hits, timed-out and killed commands, dropped output, log quota; and
        the misbehaviour report made of them: findings and a verdict, by
        the node's rules or by `rules` (corral.Rules)."""
        report = await self._service.audit(self.id)
        return rules.judge(report) if rules is not None else report

    async def direct(self, ttl: int = 300) -> AsyncSandbox:
        """This sandbox on a direct path to its node, past the gateway, for
        `ttl` seconds (at most an hour): commands, files, the display, usage
        and audit go straight to the node with a token the gateway signed
        (docs/direct-path.md). Its lifetime (close, suspend, fork, TTL,
        network, protect, commit) stays with this handle. When the token
        expires, its calls raise Unauthenticated: call direct() again."""
        from corral.api.http import HttpService

        access = await self._service.direct(self.id, ttl)
        path = HttpService(access.url, api_key=access.token)
        adopt = getattr(self._service, "adopt", None)
        if adopt is not None:
            adopt(path)  # closed with the client
        return AsyncSandbox(path, self.info.model_copy(update={"id": access.sandbox_id}))

    async def protect(self, paths: list[str]) -> None:
        """Protect paths (the task's tests, its grader) from now on: a
        later write to one, or under one, is a protected_write violation
        in the report. What they hold now is the baseline (a container's)."""
        self.info = await self._service.protect(
            self.id, validated(ProtectRequest, {"paths": paths})
        )

    async def usage(self) -> Usage:
        """What this sandbox uses now: CPU seconds, memory and disk, with
        their limits, read by the platform."""
        return await self._service.usage(self.id)

    async def suspend(self, mode: str | None = None, *, key: str | None = None) -> SandboxInfo:
        """Stop the sandbox, its processes kept; resume() or the next
        request brings it back where it was. `mode` is the depth: "freeze"
        stops its processes in place and gives its memory back to the host
        (a container's default; resumes in milliseconds); "disk" saves them
        and ends them, so it holds only disk (a VM's default). A suspended
        sandbox is left as it is. With `key`, only the first call with that
        key acts (a retried preemption hook leaves a sandbox resumed since
        running)."""
        self.info = await self._service.suspend(self.id, mode or "", key or "")
        return self.info

    async def save(self, store: str = "local") -> SavedState:
        """Suspend this sandbox to disk (a VM, or a container with CRIU) and
        copy its state to one of the
        node's named object stores (its operator names them; "local" is
        shared by the nodes that share the image store), from which
        client.sandboxes.restore() starts it on any node that has the same
        store. It stays here, suspended: resume it, or close it once the
        copy runs elsewhere."""
        saved = await self._service.save(self.id, validated(SaveRequest, {"store": store}))
        self.info = await self._service.get(self.id)
        return saved

    async def resume(self) -> SandboxInfo:
        """Bring a suspended sandbox back (a running one is left as it is)."""
        self.info = await self._service.resume(self.id)
        return self.info

    async def set_ttl(self, seconds: int) -> SandboxInfo:
        """End the sandbox's TTL `seconds` from now (0: within a second),
        however long its create gave it (E2B's set_timeout): it closes,
        or suspends if its create said on_expiry="suspend" or "disk"."""
        self.info = await self._service.set_ttl(self.id, seconds)
        return self.info

    async def close(self) -> None:
        """Stop the sandbox and release everything it holds (idempotent)."""
        await self._service.close(self.id)

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
