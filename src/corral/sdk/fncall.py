"""Stateless function calls: compile and run code on a warm worker.

    r = await client.fncall.run("python", "print(1)")
    r.status, r.stdout      # 'ok', '1\\n'

Every call starts from a clean worker (no file, process, environment or
/tmp entry of an earlier call), limited like a container sandbox and with no
network; it pays no container start.
"""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from corral.api.models import FnCallRequest, FnCallResult, validated
from corral.api.service import SandboxService
from corral.errors import CorralError, InvalidArgument


def call_request(
    language: str,
    code: str,
    *,
    stdin: str | bytes | None = None,
    files: Mapping[str, str | bytes] | None = None,
    fetch_files: builtins.list[str] | None = None,
    compile_timeout: float = 10,
    run_timeout: float = 10,
    memory: int | str = "512MiB",
    output_limit: int | str = "1MiB",
    image: str | None = None,
) -> FnCallRequest:
    """A validated call (for run_many); bad input raises InvalidArgument."""

    def raw(b: str | bytes) -> bytes:
        return b.encode() if isinstance(b, str) else b

    return validated(
        FnCallRequest,
        {
            "language": language,
            "code": code,
            "stdin": raw(stdin) if stdin is not None else None,
            "files": {k: raw(v) for k, v in (files or {}).items()},
            "fetch_files": fetch_files or [],
            "compile_timeout": compile_timeout,
            "run_timeout": run_timeout,
            "memory": memory,
            "output_limit": output_limit,
            "image": image,
        },
    )


class AsyncFnCall:
    def __init__(self, ready: Callable[[], Awaitable[SandboxService]]) -> None:
        # The client's service, started on first use (AsyncClient._ready).
        self._ready = ready

    async def run(
        self,
        language: str,
        code: str,
        *,
        stdin: str | bytes | None = None,
        files: Mapping[str, str | bytes] | None = None,
        fetch_files: builtins.list[str] | None = None,
        compile_timeout: float = 10,
        run_timeout: float = 10,
        memory: int | str = "512MiB",
        output_limit: int | str = "1MiB",
        image: str | None = None,
    ) -> FnCallResult:
        """Write `code` (and `files`) into a clean worker's /work, compile it
        if the language compiles, run it with `stdin`, and return the
        verdict: status (ok, compile_error, runtime_error, timeout,
        memory_exceeded, output_limit), exit code (-signal if killed),
        stdout, stderr, compile output, wall and CPU time, peak memory, and
        the `fetch_files` that exist afterwards. stdout and stderr are each
        capped at `output_limit` bytes."""
        req = call_request(
            language,
            code,
            stdin=stdin,
            files=files,
            fetch_files=fetch_files,
            compile_timeout=compile_timeout,
            run_timeout=run_timeout,
            memory=memory,
            output_limit=output_limit,
            image=image,
        )
        service = await self._ready()
        return await service.run_call(req)

    async def run_many(
        self,
        calls: builtins.list[FnCallRequest] | builtins.list[dict[str, Any]],
        *,
        concurrency: int = 8,
        on_result: Callable[[int, FnCallResult | CorralError], object] | None = None,
    ) -> builtins.list[FnCallResult | CorralError]:
        """Run many calls, at most `concurrency` at once. Item i's result is
        its verdict, or the error that kept it from running (one failure
        does not stop the others). `on_result(index, result)` is called as
        each finishes (in completion order); the list returned is in the
        order of `calls`. A call given as a dict takes run()'s keyword
        arguments plus `language` and `code`; all are checked before any
        runs."""
        if concurrency < 1:
            raise InvalidArgument("concurrency", "must be at least 1", concurrency)
        reqs = [c if isinstance(c, FnCallRequest) else call_request(**c) for c in calls]
        service = await self._ready()
        gate = asyncio.Semaphore(concurrency)
        results: builtins.list[FnCallResult | CorralError | None] = [None] * len(reqs)

        async def one(i: int, req: FnCallRequest) -> None:
            async with gate:
                try:
                    out: FnCallResult | CorralError = await service.run_call(req)
                except CorralError as exc:
                    out = exc
            results[i] = out
            if on_result is not None:
                on_result(i, out)

        await asyncio.gather(*(one(i, r) for i, r in enumerate(reqs)))
        return [r for r in results if r is not None]
