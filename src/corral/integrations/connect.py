"""How an adapter reaches Corral, and how the blocking adapters (SkyRL,
gymnasium) run the async episode core.

A framework config names a server by `url` (else CORRAL_URL, else an
embedded node in this process, root needed) and `api_key` (else
CORRAL_API_KEY). Blocking adapters run every coroutine on one private
event loop per process (sdk/portal.py), where their clients live: the
episode logic exists once, async.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from corral.sdk.client import AsyncClient
from corral.sdk.portal import Portal

T = TypeVar("T")

_lock = threading.Lock()
_portal: Portal | None = None
_clients: dict[tuple[str | None, str | None], AsyncClient] = {}


def client(url: str | None = None, api_key: str | None = None) -> AsyncClient:
    """A new client for the configured server (started on first use)."""
    url = url or os.environ.get("CORRAL_URL") or None
    api_key = api_key or os.environ.get("CORRAL_API_KEY") or None
    return AsyncClient(url, api_key=api_key)


def blocking(fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
    """Run a coroutine function on the process's adapter loop and wait."""
    global _portal
    with _lock:
        if _portal is None:
            _portal = Portal()
        portal = _portal
    return portal.call(fn, *args, **kwargs)


def shared_client(url: str | None = None, api_key: str | None = None) -> AsyncClient:
    """The adapter loop's client for this server: one per process, shared
    by every blocking environment (a trainer makes thousands of them)."""
    key = (url or os.environ.get("CORRAL_URL") or None, api_key)
    with _lock:
        found = _clients.get(key)
        if found is None:
            found = _clients[key] = client(*key)
        return found
