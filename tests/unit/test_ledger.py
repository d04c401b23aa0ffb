"""The ledger: a sandbox's resources released newest first, past any
that fails, and the rows of only those that went dropped; a kind owned by
two different releasers refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.node.ledger import Ledger, combine
from corral.node.store import Store
from corral.runtimes.base import Releaser

from .test_store import _rec


async def test_released_newest_first_past_a_failure_and_only_the_failed_row_kept(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "state.db")
    store.insert(_rec("s1"))
    store.insert(_rec("s2"))
    for kind, ref in [("dir", "d1"), ("socket", "k1"), ("cgroup", "c1"), ("dir", "d2")]:
        store.add_resource("s1", kind, ref)
    store.add_resource("s2", "dir", "other")
    seen: list[tuple[str, str]] = []

    def releaser(kind: str, fail: str = "") -> Releaser:
        async def release(ref: str) -> None:
            seen.append((kind, ref))
            if ref == fail:
                raise OSError(f"{ref} is busy")

        return release

    ledger = Ledger(store, {"dir": releaser("dir"), "socket": releaser("socket", fail="k1"),
                            "cgroup": releaser("cgroup")})  # fmt: skip
    errors = await ledger.release_all("s1")

    assert seen == [("dir", "d2"), ("cgroup", "c1"), ("socket", "k1"), ("dir", "d1")]
    assert errors == ["socket k1: k1 is busy"]
    assert store.resources("s1") == [("socket", "k1")]  # what failed is retried later
    assert store.resources("s2") == [("dir", "other")]  # another sandbox's untouched
    with pytest.raises(ValueError, match="unknown resource kind 'vm'"):
        await ledger.release("vm", "x")


def test_a_kind_with_two_different_releasers_is_refused() -> None:
    async def one(ref: str) -> None: ...

    async def two(ref: str) -> None: ...

    assert combine({"dir": one}, {"dir": one}) == {"dir": one}  # shared by two runtimes
    with pytest.raises(ValueError, match="'dir' has two releasers"):
        combine({"dir": one}, {"dir": two})
