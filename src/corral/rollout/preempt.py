"""A trainer that survives being killed: the preemption test's and the
demo's agent loop.

    python -m corral.rollout.preempt URL JOB ROLLOUTS STEPS OUT

drives ROLLOUTS rollouts of STEPS steps each against the Corral at URL, all
at once. A step is a policy's action (a random number, recorded in the
rollout's log: a real trainer's LLM call) and a command with side effects
counted inside the sandbox: it appends the step and the action to a file
and bumps a counter, and its output is what the policy sees next. At the
end each rollout reads its file back, and OUT gets every rollout's results
as JSON.

Kill it at any moment (SIGKILL) and run it again with the same arguments:
it fast-forwards through what its rollouts logged and continues live; no
step runs twice (sdk/rollouts.py says why).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.api.models import SavedState
from corral.api.service import SandboxService
from corral.config import NodeConfig
from corral.errors import Conflict, CorralError
from corral.sdk.client import AsyncClient, BulkOutcome
from corral.sdk.sandbox import AsyncSandbox

IMAGE = "debian-python:bookworm"
STEP = (
    "echo {k}:{action} >> /tmp/trajectory; "
    "n=$(cat /tmp/steps 2>/dev/null || echo 0); echo $((n+1)) > /tmp/steps; cat /tmp/steps"
)


def rollout_name(job: str, i: int) -> str:
    return f"{job}-{i}"


async def one(client: AsyncClient, job: str, i: int, steps: int) -> dict[str, Any]:
    r = await client.rollouts.open(rollout_name(job, i))
    sbx = await r.create(image=IMAGE, memory="64MiB", labels={"job": job}, idle_timeout=None)
    seen = "0"
    results: list[str] = []
    for k in range(steps):
        action = await r.record("policy", lambda: random.randint(0, 10**6), args=[k, seen])
        res = await sbx.commands.run(STEP.format(k=k, action=action))
        seen = res.stdout.strip()
        results.append(f"{k}:{action}:{seen}")
    trajectory = await sbx.files.read_text("/tmp/trajectory")
    return {"sandbox": sbx.id, "results": results, "trajectory": trajectory.splitlines()}


async def train(url: str, job: str, rollouts: int, steps: int) -> list[dict[str, Any]]:
    async with AsyncClient(url, api_key=os.environ.get("CORRAL_API_KEY")) as client:
        return list(await asyncio.gather(*(one(client, job, i, steps) for i in range(rollouts))))


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    url, job, rollouts, steps, out = argv
    results = asyncio.run(train(url, job, int(rollouts), int(steps)))
    tmp = Path(f"{out}.tmp")
    tmp.write_text(json.dumps(results))
    os.replace(tmp, out)
    return 0


STEPS_PER_STEP = 2  # a rollout's log: create, (policy, command) per step, read back


def logged_steps(steps: int) -> int:
    return STEPS_PER_STEP * steps + 2


@dataclass
class Survival:
    """What happened to a job whose trainer was killed."""

    rollouts: int
    steps: int
    killed_at: int  # steps logged (all rollouts) when the trainer was killed
    preempted: int  # sandboxes the preemption hook handled (suspended, or moved)
    preempt_s: float
    problems: list[str]  # check()'s findings: [] when every step ran once
    refused: list[str]  # why sandboxes were not handled (the hook's errors)
    restart_s: float  # the restarted trainer, start to end
    results: list[dict[str, Any]]


# What a job's preemption does to its sandboxes once the trainer is dead:
# their outcomes, one per sandbox (ok: ready for the trainer to come back).
Hook = Callable[[AsyncClient, str], Awaitable[list[BulkOutcome]]]


def suspend_hook(mode: str | None = None) -> Hook:
    """DSec's preemption hook: suspend the job in place (at depth `mode`)."""

    async def hook(client: AsyncClient, job: str) -> list[BulkOutcome]:
        outcomes = await client.sandboxes.suspend_many(
            {"job": job}, mode=mode, key=f"{job}-preempt"
        )
        return [o if o.info is None or o.info.state == "suspended" else
                BulkOutcome(o.id, o.info, Conflict(f"{o.id} is {o.info.state}, not suspended"))
                for o in outcomes]  # fmt: skip

    return hook


def move_hook(between: Callable[[], Awaitable[None]], store: str = "local") -> Hook:
    """A preemption that takes the job's hosts too: each sandbox is saved
    (to disk, then to `store`) and closed; `between()` runs (the hosts go,
    others come); then each is restored, wherever the gateway places it."""

    async def hook(client: AsyncClient, job: str) -> list[BulkOutcome]:
        gate = asyncio.Semaphore(8)

        async def save(sbx: AsyncSandbox) -> SavedState:
            async with gate:
                saved = await sbx.save(store)
                await sbx.close()
                return saved

        async def restore(saved: SavedState) -> BulkOutcome:
            async with gate:
                try:
                    moved = await client.sandboxes.restore(
                        saved, idempotency_key=f"{job}-{saved.sandbox}"
                    )
                except CorralError as exc:
                    return BulkOutcome(saved.sandbox, None, exc)
                return BulkOutcome(moved.id, moved.info)

        states = await asyncio.gather(*(save(s) for s in await client.sandboxes.list({"job": job})))
        await between()
        return list(await asyncio.gather(*(restore(s) for s in states)))

    return hook


def _trainer(
    url: str, job: str, rollouts: int, steps: int, out: Path, api_key: str | None
) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "corral.rollout.preempt", url, job, str(rollouts), str(steps)]
    env = {**os.environ, **({"CORRAL_API_KEY": api_key} if api_key else {})}
    with open(out.with_suffix(".log"), "ab") as log_file:  # the child keeps its copy
        return subprocess.Popen([*argv, str(out)], stderr=log_file, env=env)


def _log_tail(out: Path) -> str:
    """The end of the trainer's stderr: why it failed."""
    return out.with_suffix(".log").read_text(errors="replace")[-2000:]


async def _logged(service: SandboxService, job: str, rollouts: int) -> list[int]:
    names = [rollout_name(job, i) for i in range(rollouts)]
    return [len(s) for s in await asyncio.gather(*(service.rollout_steps(n) for n in names))]


async def survive(
    url: str,
    job: str,
    rollouts: int,
    steps: int,
    out: Path,
    kill_at: int | None = None,
    hook: Hook | None = None,
    api_key: str | None = None,
) -> Survival:
    """Run the trainer against the Corral at `url`, SIGKILL it once its
    rollouts have logged `kill_at` steps in all (random, after every
    rollout has its sandbox, if None), preempt the job's sandboxes with
    `hook` (suspend_hook() if None), run the trainer again, and check."""
    hook = hook or suspend_hook()
    total = rollouts * logged_steps(steps)
    if kill_at is None:
        kill_at = random.randint(rollouts * 2, total - rollouts * 4)
    trainer = _trainer(url, job, rollouts, steps, out, api_key)
    async with AsyncClient(url, api_key=api_key) as client:
        service = await client._ready()
        deadline = time.monotonic() + 600
        try:
            while True:
                counts = await _logged(service, job, rollouts)
                if sum(counts) >= kill_at and min(counts) >= 1:
                    break
                if trainer.poll() is not None:
                    raise RuntimeError(
                        f"the trainer ended (exit {trainer.returncode}) early: {_log_tail(out)}"
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the trainer made no progress: {counts}")
                await asyncio.sleep(0.05)
        finally:
            trainer.kill()
            trainer.wait()
        killed_at = sum(await _logged(service, job, rollouts))
        t0 = time.monotonic()
        outcomes = await hook(client, job)
        preempt_s = time.monotonic() - t0
        preempted = sum(o.ok for o in outcomes)
        t0 = time.monotonic()
        restarted = _trainer(url, job, rollouts, steps, out, api_key)
        code = await asyncio.to_thread(restarted.wait, 600)
        refused = sorted({o.error.message for o in outcomes if o.error is not None})
        if code != 0:
            raise RuntimeError(
                f"the restarted trainer failed (exit {code}): {_log_tail(out)}\n"
                f"the preemption hook's refusals: {refused or 'none'}"
            )
        results = json.loads(out.read_text())
        return Survival(rollouts, steps, killed_at, preempted, preempt_s, check(results, steps),
                        refused, time.monotonic() - t0, results)  # fmt: skip


def _serve(config: NodeConfig, sock: Path) -> subprocess.Popen[bytes]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "corral.cli.main", "--data-dir", str(config.data_dir), "serve",
            "--socket", str(sock), "--port", str(port), "--log-level", "warning"]  # fmt: skip
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def survive_on_a_server(
    config: NodeConfig, rollouts: int, steps: int, mode: str | None = None
) -> Survival:
    """survive() on this node, served by a `corral serve` of its own: the
    node outlives the trainer, as sandbox hosts outlive a preempted
    training job (an embedded trainer takes its node agent down with it,
    and the commands it had in flight become Ambiguous)."""
    sock = config.data_dir / "run" / f"preempt-{os.getpid()}.sock"
    server = _serve(config, sock)
    job = f"preempt-{os.getpid()}"
    try:
        for _ in range(600):
            if sock.exists() or server.poll() is not None:
                break
            await asyncio.sleep(0.05)
        if not sock.exists():
            raise RuntimeError(f"corral serve did not start (exit {server.poll()})")
        url = f"unix:{sock}"
        with tempfile.TemporaryDirectory() as tmp:
            try:
                out = Path(tmp) / "results.json"
                return await survive(url, job, rollouts, steps, out, hook=suspend_hook(mode))
            finally:
                await clean(url, job, rollouts)
    finally:
        server.terminate()
        server.wait(30)


async def clean(url: str, job: str, rollouts: int, api_key: str | None = None) -> None:
    """Close the job's sandboxes and drop its logs."""
    async with AsyncClient(url, api_key=api_key) as client:
        await asyncio.gather(
            *(s.close() for s in await client.sandboxes.list(labels={"job": job})),
            *(client.rollouts.delete(rollout_name(job, i)) for i in range(rollouts)),
        )


def check(results: list[dict[str, Any]], steps: int) -> list[str]:
    """What is wrong with a job's results (nothing: []). Every rollout must
    have run each step exactly once, in order: its file holds one line per
    step, with the action the trainer reports, and the counter the command
    saw is the step's number."""
    problems = []
    for i, r in enumerate(results):
        want = [line.rsplit(":", 1)[0] for line in r["results"]]
        if r["trajectory"] != want:
            problems.append(f"rollout {i}: trajectory {r['trajectory']} != steps {want}")
        counts = [int(line.rsplit(":", 1)[1]) for line in r["results"]]
        if counts != list(range(1, steps + 1)):
            problems.append(f"rollout {i}: step counters {counts}")
    return problems


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
