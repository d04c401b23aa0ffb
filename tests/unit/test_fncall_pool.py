"""The function-call pool's prepare step (a warm language's workers), with
fake workers: it runs after a worker is made and after every reset, and a
worker whose prepare fails never serves a call."""

from __future__ import annotations

import asyncio

import pytest

from corral.api.models import CreateSandbox
from corral.node.fncall.pool import WorkerPool, WorkerSpec

pytestmark = pytest.mark.unit


class Fakes:
    def __init__(self, fail_prepare: set[int] | None = None) -> None:
        self.made = 0
        self.events: list[str] = []
        self.closed: list[str] = []
        self.requests: list[CreateSandbox] = []
        self.fail_prepare = fail_prepare or set()
        self.prepares = 0

    async def create(self, req: CreateSandbox) -> str:
        self.made += 1
        self.requests.append(req)
        return f"w{self.made}"

    async def reset(self, worker: str) -> None:
        self.events.append(f"reset {worker}")

    async def close(self, worker: str) -> None:
        self.closed.append(worker)

    async def prepare(self, key: str, worker: str) -> None:
        self.prepares += 1
        self.events.append(f"prepare {key} {worker}")
        if self.prepares in self.fail_prepare:
            raise RuntimeError("kernel did not start")

    def pool(self) -> WorkerPool:
        return WorkerPool(
            self.create, self.reset, self.close, size=1,
            spec=WorkerSpec(cpu=1, memory=2**30, pids=64), prepare=self.prepare,
        )  # fmt: skip


async def test_prepare_runs_after_the_make_and_after_each_reset() -> None:
    f = Fakes()
    pool = f.pool()
    w = await pool.acquire("img+tk#jupyter")
    assert f.events == ["prepare img+tk#jupyter w1"]
    # The language part of the key is the pool's, not the worker's image.
    assert f.requests[0].image == "img" and f.requests[0].toolkit == ["tk"]
    pool.release("img+tk#jupyter", w, healthy=True)
    assert await pool.acquire("img+tk#jupyter") == "w1"
    assert f.events[1:] == ["reset w1", "prepare img+tk#jupyter w1"]
    pool.release("img+tk#jupyter", "w1", healthy=False)
    await pool.aclose()


async def test_a_worker_whose_prepare_fails_never_serves() -> None:
    f = Fakes(fail_prepare={1})
    pool = f.pool()
    with pytest.raises(RuntimeError, match="kernel did not start"):
        await pool.acquire("img#jupyter")
    assert f.closed == ["w1"] and pool.stats()["img#jupyter"]["workers"] == 0
    # After a reset: the failed worker is closed, and a new one takes its slot.
    f.fail_prepare = {3}
    w = await pool.acquire("img#jupyter")
    assert w == "w2"
    pool.release("img#jupyter", w, healthy=True)
    for _ in range(50):
        if "w2" in f.closed:
            break
        await asyncio.sleep(0.01)
    assert "w2" in f.closed
    assert await pool.acquire("img#jupyter") == "w3"
    pool.release("img#jupyter", "w3", healthy=False)
    await pool.aclose()
