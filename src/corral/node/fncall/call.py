"""One function call on a clean worker: files in, compile, run, files out,
and the verdict.

The call runs as an unprivileged user (CALL_USER) in /work; its memory
limit is set on the worker's cgroup for the call, so an OOM kill is told
apart from a crash by the cgroup's counter, not guessed from the signal.
"""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass

from corral.api.models import FnCallRequest, FnCallResult, FnCallStage, FnCallStatus
from corral.errors import CorralError, SandboxFailed
from corral.execd import protocol as proto
from corral.execd.client import ExecdClient
from corral.host.cgroups import Cgroups
from corral.node.fncall.languages import Language

CALL_USER = "1000:1000"
STAGE_GRACE = 10.0  # past a stage's timeout, the host ends it itself
WORK = "/work"
FETCH_LIMIT = 16 * 1024 * 1024  # per file
FETCH_TOTAL = 64 * 1024 * 1024  # per call: hard links make 64 names cheap to fill
ENV = [
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME=/tmp",
    "TMPDIR=/tmp",
    "LANG=C.UTF-8",
    "PYTHONDONTWRITEBYTECODE=1",
]


def _env(lang: Language) -> list[str]:
    """The call's environment; a language's own entries replace ours."""
    merged = dict(e.partition("=")[::2] for e in (*ENV, *lang.env))
    return [f"{k}={v}" for k, v in merged.items()]


@dataclass(frozen=True)
class Worker:
    id: str
    execd: ExecdClient
    cgroups: Cgroups


async def _stage(
    w: Worker, lang: Language, argv: list[str], stdin: bytes | None, timeout: float, limit: int
) -> FnCallStage:
    t0 = time.monotonic()
    session = await w.execd.start(
        argv,
        _env(lang),
        user=CALL_USER,
        cwd=WORK,
        timeout=timeout,
        stdout_cap=limit,
        stderr_cap=limit,
        stdin=stdin,
    )
    out: list[bytes] = []
    err: list[bytes] = []
    x: proto.Exit | None = None
    try:
        # The server ends a call at its timeout, but the call's code runs
        # as the same user as the handler that would: it can stop it
        # (kill -STOP -1) and run on. The host's own bound makes that a
        # timeout like any other (the reset at release ends what is left).
        async with asyncio.timeout(timeout + STAGE_GRACE):
            async for kind, payload in session.events():
                if kind == proto.RSP_EXIT:
                    x = proto.parse_exit(payload)
                else:
                    (out if kind == proto.RSP_STDOUT else err).append(payload)
    except TimeoutError:
        session.close()
        x = proto.Exit(exit_code=-1, signal=int(signal.SIGKILL), timed_out=True, stdout_bytes=0,
                       stderr_bytes=0, cpu_user=0.0, cpu_system=0.0, max_rss=0)  # fmt: skip
    if x is None:
        raise ConnectionError("the worker's exec server closed the call")
    return FnCallStage(
        # Killed by a signal: -signal, as Python's subprocess reports it.
        exit_code=-x.signal if x.signal else x.exit_code,
        signal=x.signal,
        timed_out=x.timed_out,
        stdout=b"".join(out).decode(errors="replace"),
        stderr=b"".join(err).decode(errors="replace"),
        truncated=x.stdout_bytes > limit or x.stderr_bytes > limit,
        wall_time=time.monotonic() - t0,
        cpu_time=x.cpu_user + x.cpu_system,
        peak_memory=x.max_rss,
    )


async def prepare(w: Worker, lang: Language) -> None:
    """The language's prepare step on a clean worker; a failure is the
    worker's (it is closed and replaced), not a call's."""
    assert lang.prepare is not None
    stage = await _stage(w, lang, list(lang.prepare), None, 60.0, 64 * 1024)
    if stage.exit_code != 0 or stage.timed_out:
        raise SandboxFailed(
            f"{lang.name}'s prepare step failed (exit {stage.exit_code}): {stage.stderr[-500:]}"
        )


def _verdict(stage: FnCallStage, oom: bool, compiling: bool) -> FnCallStatus:
    if stage.timed_out:
        return "timeout"
    if oom:
        return "memory_exceeded"
    if compiling:
        return "compile_error" if stage.exit_code != 0 else "ok"
    if stage.truncated:
        return "output_limit"
    return "runtime_error" if stage.exit_code != 0 else "ok"


async def run(w: Worker, lang: Language, req: FnCallRequest) -> FnCallResult:
    w.cgroups.set_memory(w.id, req.memory)
    ooms = w.cgroups.oom_kills(w.id)
    made: set[str] = set()
    for name, data in req.files.items():
        parent = name.rpartition("/")[0]
        if parent and parent not in made:  # as the call's user, inside /work only
            await w.execd.mkdir(CALL_USER, f"{WORK}/{parent}", parents=True)
            made.add(parent)
        await w.execd.write(CALL_USER, f"{WORK}/{name}", data, max_bytes=len(data))
    code = req.code.encode()
    await w.execd.write(CALL_USER, f"{WORK}/{lang.source}", code, max_bytes=len(code))

    compiled: FnCallStage | None = None
    if lang.compile is not None:
        compiled = await _stage(
            w, lang, list(lang.compile), None, req.compile_timeout, req.output_limit
        )
        oom = w.cgroups.oom_kills(w.id) > ooms
        status = _verdict(compiled, oom, compiling=True)
        if status != "ok":
            return _result(status, compiled, None, {})
    ran = await _stage(w, lang, list(lang.run), req.stdin, req.run_timeout, req.output_limit)
    status = _verdict(ran, w.cgroups.oom_kills(w.id) > ooms, compiling=False)
    files: dict[str, bytes] = {}
    budget = FETCH_TOTAL
    for name in req.fetch_files:
        try:
            path = name if name.startswith("/") else f"{WORK}/{name}"
            data = await w.execd.read(CALL_USER, path, min(FETCH_LIMIT, budget))
        except CorralError:
            continue  # missing, a directory, too big, unreadable: the code's doing
        files[name] = data
        budget -= len(data)
        if budget <= 0:
            break
    return _result(status, compiled, ran, files)


def _result(
    status: FnCallStatus,
    compiled: FnCallStage | None,
    ran: FnCallStage | None,
    files: dict[str, bytes],
) -> FnCallResult:
    last = ran or compiled
    assert last is not None
    stages = [s for s in (compiled, ran) if s is not None]
    return FnCallResult(
        status=status,
        exit_code=last.exit_code,
        stdout=ran.stdout if ran else "",
        stderr=ran.stderr if ran else "",
        compile_output=(compiled.stdout + compiled.stderr) if compiled else "",
        wall_time=sum(s.wall_time for s in stages),
        cpu_time=sum(s.cpu_time for s in stages),
        peak_memory=max(s.peak_memory for s in stages),
        files=files,
        compile=compiled,
        run=ran,
    )
