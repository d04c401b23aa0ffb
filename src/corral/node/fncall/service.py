"""Function calls on a node: the language table, the warm pool, and the
call that ties them together."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from corral import metrics
from corral.api.models import CreateSandbox, FnCallRequest, FnCallResult, SandboxInfo
from corral.config import NodeConfig
from corral.errors import InvalidArgument
from corral.execd.client import ExecdClient
from corral.host.cgroups import Cgroups
from corral.images.store import ImageStore
from corral.log import get_logger
from corral.node.fncall import call, languages
from corral.node.fncall.pool import POOL_LABEL, WorkerPool, WorkerSpec, reset_worker

log = get_logger("corral.fncall")


class FnCalls:
    def __init__(
        self,
        config: NodeConfig,
        images: ImageStore,
        cgroups: Cgroups,
        *,
        create: Callable[[CreateSandbox], Awaitable[SandboxInfo]],
        retire: Callable[[str, str], Awaitable[None]],
        execd: Callable[[str], ExecdClient],
    ) -> None:
        cfg = config
        self.config = config
        self.images = images
        self.cgroups = cgroups
        self._create_sandbox, self._retire_sandbox, self._execd = create, retire, execd
        self.languages = languages.load(languages.SHIPPED, cfg.data_dir / "fncall-languages.toml")
        self.pool = WorkerPool(
            create=self._create,
            reset=self.reset,
            close=self._retire,
            size=cfg.fncall_workers,
            total=cfg.fncall_workers_total or None,
            spec=WorkerSpec(cpu=cfg.fncall_cpu, memory=cfg.fncall_max_memory, pids=cfg.fncall_pids),
            prepare=self._prepare,
        )

    async def _create(self, req: CreateSandbox) -> str:
        # The pool's label is set past validation: callers cannot use it.
        own = req.model_copy(update={"labels": {**req.labels, POOL_LABEL: "fncall"}})
        return (await self._create_sandbox(own)).id

    async def _retire(self, worker: str) -> None:
        await self._retire_sandbox(worker, "function-call worker retired")

    async def reset(self, sandbox_id: str) -> None:
        await reset_worker(self._execd(sandbox_id))

    async def _prepare(self, key: str, worker: str) -> None:
        """Ready a worker of a language that has a `prepare` step (keys
        IMAGE#LANGUAGE); other workers need nothing past their reset."""
        _, _, name = key.partition("#")
        lang = self.languages.get(name) if name else None
        if lang is not None and lang.prepare is not None:
            w = call.Worker(worker, self._execd(worker), self.cgroups)
            await call.prepare(w, lang)

    def language(self, name: str) -> languages.Language:
        lang = self.languages.get(name)
        if lang is None:
            known = sorted({x.name for x in self.languages.values() if not x.unavailable})
            raise InvalidArgument("language", f"must be one of {', '.join(known)}", name)
        if lang.unavailable:
            raise InvalidArgument(
                "language", f"has no toolchain on this node: {lang.unavailable}", name
            )
        return lang

    async def run(self, req: FnCallRequest) -> FnCallResult:
        lang = self.language(req.language)
        ceiling = self.config.fncall_max_memory
        if req.memory > ceiling:
            raise InvalidArgument(
                "memory",
                f"must be at most {ceiling} bytes for a function call on this node "
                "(fncall_max_memory)",
                req.memory,
            )
        # A call that names its image gets that image alone; a language may
        # name its own; the rest run on the node's default workers.
        image = req.image or lang.image or self.config.fncall_worker
        base, _, toolkit = image.partition("+")
        # A clear error before any worker; another project's layer is not here.
        toolkits = [t for t in toolkit.split(",") if t]
        fields = [("image", base), *((f"fncall_toolkit[{i}]", t) for i, t in enumerate(toolkits))]
        for field, ref in fields:
            layer = self.images.get(self.images.digest_of(ref, field), names=False)
            self.images.for_project(layer, req.project, field, by_name=ref.startswith("sha256:"))
            for below in self.images.chain(layer)[:-1] if field == "image" else []:
                self.images.for_project(below, req.project, field)
        if lang.prepare is not None:
            image = f"{image}#{lang.name}"
        t0 = time.monotonic()
        worker = await self.pool.acquire(image)
        healthy = False
        try:
            w = call.Worker(worker, self._execd(worker), self.cgroups)
            result = (await call.run(w, lang, req)).model_copy(update={"worker": worker})
            healthy = True
        finally:
            self.pool.release(image, worker, healthy)
        metrics.FNCALLS.labels(req.language, result.status).inc()
        metrics.FNCALL_SECONDS.observe(time.monotonic() - t0)
        for img, counts in self.pool.stats().items():
            metrics.FNCALL_WORKERS.labels(img, "idle").set(counts["idle"])
            metrics.FNCALL_WORKERS.labels(img, "total").set(counts["workers"])
        return result
