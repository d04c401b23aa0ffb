"""Warm workers for function calls, per image.

A worker is a container sandbox of kind "fncall" (read-only root; /tmp and
/work are tmpfs) that serves one call at a time. Between two calls it is
reset (every process killed, the writable dirs emptied, SysV IPC dropped)
before it goes back to the queue, so a call never sees what the last one
left and pays no container start. A worker that fails its reset is closed
and replaced.

Invariant: for each image, `_count` workers exist; each is either in the
queue (idle and clean), held by exactly one call, or being reset.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from corral import labels
from corral.api.models import CreateSandbox
from corral.errors import Unavailable
from corral.execd.client import ExecdClient
from corral.log import get_logger

log = get_logger("corral.fncall")

# The only places a call can write (the root is read-only).
RESET_DIRS = ["/tmp", "/work", "/mnt", "/dev/shm", "/dev/mqueue"]
POOL_LABEL = labels.POOL
WAIT_FOR_WORKER = 120.0
PREPARE_WITHIN = 90.0


async def reset_worker(execd: ExecdClient) -> None:
    """Return a worker to a clean state: every process killed, the
    writable dirs emptied. Killing first is answered by init itself: it
    works even when a fork bomb left no pid for the reset's own handler."""
    await execd.kill(0, signal.SIGKILL)
    await execd.reset(RESET_DIRS)


@dataclass(frozen=True)
class WorkerSpec:
    cpu: float
    memory: int  # the ceiling; each call sets its own limit under it
    pids: int


class WorkerPool:
    def __init__(
        self,
        create: Callable[[CreateSandbox], Awaitable[str]],
        reset: Callable[[str], Awaitable[None]],
        close: Callable[[str], Awaitable[None]],
        size: int,
        spec: WorkerSpec,
        total: int | None = None,
        prepare: Callable[[str, str], Awaitable[None]] | None = None,
    ) -> None:
        self._create, self._reset, self._close = create, reset, close
        # (key, worker) after a worker is made and after each reset: a key
        # "IMAGE#LANGUAGE" is a pool of workers made ready for that language.
        self._prepare = prepare
        self.size = size  # workers per image
        # Workers across images: an image nobody calls any more gives its
        # idle workers up to the images being called.
        self.total = total or 2 * size
        self.spec = spec
        self._idle: dict[str, asyncio.Queue[str]] = {}
        self._count: dict[str, int] = {}
        self._waiting: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._held = 0  # workers handed to calls and not yet released
        self._none_held = asyncio.Event()
        self._none_held.set()

    def _request(self, image: str) -> CreateSandbox:
        """A worker for `image`: IMAGE[+TOOLKIT,...][#LANGUAGE] (NodeConfig.fncall_worker)."""
        base, _, toolkit = image.partition("#")[0].partition("+")
        return CreateSandbox(
            kind="fncall",
            image=base,
            toolkit=[t for t in toolkit.split(",") if t],
            cpu=self.spec.cpu,
            memory=self.spec.memory,
            disk=16 * 1024 * 1024,
            pids=self.spec.pids,
            ttl=None,
            idle_timeout=None,
        )

    def _queue(self, image: str) -> asyncio.Queue[str]:
        if image not in self._idle:
            self._idle[image] = asyncio.Queue()
            self._count[image] = 0
            self._waiting[image] = 0
        return self._idle[image]

    async def _new(self, image: str) -> str:
        self._count[image] += 1
        try:
            worker = await self._create(self._request(image))
        except BaseException:
            self._count[image] -= 1
            raise
        try:
            if self._prepare is not None:
                async with asyncio.timeout(PREPARE_WITHIN):
                    await self._prepare(image, worker)
        except BaseException:
            self._count[image] -= 1
            await self._discard(worker)
            raise
        return worker

    async def acquire(self, image: str) -> str:
        """A clean worker for one call; the caller must release() it.

        The call counts as held from the start, while its worker is still
        being made too: a close waits for it, instead of closing the node
        under a worker half made (a closed store, its mounts left)."""
        self._held += 1
        self._none_held.clear()
        try:
            return await self._acquire(image)
        except BaseException:
            self._held -= 1
            if not self._held:
                self._none_held.set()
            raise

    async def _acquire(self, image: str) -> str:
        if self._closed:
            raise Unavailable("the function-call pool is closed")
        q = self._queue(image)
        if q.empty() and self._count[image] < self.size:
            if sum(self._count.values()) >= self.total:
                self._evict_idle(other_than=image)
            if sum(self._count.values()) < self.total:
                return await self._new(image)
        self._waiting[image] += 1
        try:
            async with asyncio.timeout(WAIT_FOR_WORKER):
                return await q.get()
        except TimeoutError:
            raise Unavailable(
                f"no function-call worker for {image} became free in {WAIT_FOR_WORKER:.0f}s"
            ) from None
        finally:
            self._waiting[image] -= 1

    def release(self, image: str, worker: str, healthy: bool) -> None:
        """Reset the worker in the background and queue it again."""
        self._held -= 1
        if not self._held:
            self._none_held.set()
        self._spawn(self._recycle(image, worker, healthy))

    async def warm(self, image: str, n: int) -> None:
        """Start workers until `n` exist for the image (at most the size)."""
        q = self._queue(image)

        async def one() -> None:
            q.put_nowait(await self._new(image))  # usable as soon as it is ready

        want = min(n, self.size) - self._count[image]
        await asyncio.gather(*(one() for _ in range(max(0, want))))

    async def _recycle(self, image: str, worker: str, healthy: bool) -> None:
        if healthy and not self._closed:
            try:
                async with asyncio.timeout(30):
                    await self._reset(worker)
                if self._prepare is not None:
                    async with asyncio.timeout(PREPARE_WITHIN):
                        await self._prepare(image, worker)
            except Exception as exc:
                log.warning("fncall.reset_failed", worker=worker, error=str(exc))
            else:
                starved = self._starved(other_than=image)
                if starved is None:
                    self._idle[image].put_nowait(worker)
                    return
                # Another image waits with no room left: this worker goes,
                # and one of that image takes its place.
                self._count[image] -= 1
                await self._discard(worker)
                await self._replace(starved)
                return
        self._count[image] -= 1
        await self._discard(worker)
        # The slot is free: give it to whoever waits (this image first).
        for img in [image, *self._waiting]:
            if self._waiting[img] and self._count[img] < self.size:
                await self._replace(img)
                break

    async def _replace(self, image: str) -> None:
        if self._closed:
            return
        try:
            self._idle[image].put_nowait(await self._new(image))
        except Exception as exc:
            log.error("fncall.replace_failed", image=image, error=str(exc))

    def _evict_idle(self, other_than: str) -> bool:
        """Retire one idle worker of another image (the one with most idle)."""
        idle = [(q.qsize(), img) for img, q in self._idle.items() if img != other_than]
        if not idle or max(idle)[0] == 0:
            return False
        _, img = max(idle)
        worker = self._idle[img].get_nowait()
        self._count[img] -= 1
        self._spawn(self._discard(worker))
        return True

    def _starved(self, other_than: str) -> str | None:
        """An image whose callers wait with none of its workers to wait
        for, while every worker slot is taken."""
        if sum(self._count.values()) < self.total:
            return None
        for img, waiting in self._waiting.items():
            if img != other_than and waiting and self._count[img] < self.size:
                return img
        return None

    async def _discard(self, worker: str) -> None:
        try:
            await self._close(worker)
        except Exception as exc:
            log.warning("fncall.close_failed", worker=worker, error=str(exc))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stats(self) -> dict[str, dict[str, int]]:
        return {
            image: {"workers": self._count[image], "idle": q.qsize()}
            for image, q in self._idle.items()
        }

    async def aclose(self) -> None:
        """Close every worker; calls still running finish first (for a
        bounded time: the agent is going away)."""
        self._closed = True
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(60):
                await self._none_held.wait()
        while self._tasks:
            with contextlib.suppress(Exception):
                await asyncio.gather(*list(self._tasks))
        idle = []
        for q in self._idle.values():
            while not q.empty():
                idle.append(q.get_nowait())
        await asyncio.gather(*(self._discard(w) for w in idle))
