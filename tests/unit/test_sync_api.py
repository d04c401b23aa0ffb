"""The blocking API is generated from the async one and must not drift."""

from __future__ import annotations

import inspect

import corral
from corral.sdk import gen_sync


def test_committed_sync_module_is_what_the_generator_writes() -> None:
    assert gen_sync.TARGET.read_text() == gen_sync.generate(), (
        "src/corral/sdk/sync.py is stale: run python -m corral.sdk.gen_sync"
    )


def test_every_async_method_has_a_blocking_twin() -> None:
    for async_cls, name in gen_sync.CLASSES:
        sync_cls = getattr(corral, name)
        for attr, member in inspect.getmembers(async_cls):
            if attr.startswith("_") or attr in ("open", "aclose"):
                continue
            assert hasattr(sync_cls, attr), f"{name}.{attr} is missing"
            if inspect.iscoroutinefunction(member):
                assert not inspect.iscoroutinefunction(getattr(sync_cls, attr))
