"""A private event loop on a daemon thread, for the blocking client.

Every call of the blocking API is the matching coroutine of the async API run
on this loop; nothing is implemented twice.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Portal:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="corral-portal", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("the blocking client cannot be called from its own callbacks")

        async def run() -> T:
            return await fn(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result()

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
