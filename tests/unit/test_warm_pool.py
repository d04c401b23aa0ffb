"""The warm pool's bookkeeping without a kernel: it grows toward the last
minute's demand per stack within its size, hands each sandbox out once,
skips one taken meanwhile, and gives everything back when closed (the
claim itself is tested on the real host: tests/integration/test_warm_pool.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from corral.api.models import CreateSandbox, validated
from corral.config import NodeConfig
from corral.errors import NodeFull, SandboxFailed
from corral.node.admission import NotWarm
from corral.node.warmpool import WarmPool

pytestmark = pytest.mark.unit


@dataclass
class Layer:
    digest: str


@dataclass
class Info:
    id: str


@dataclass
class FakeLifecycle:
    """The lifecycle's four calls the pool makes (a transport seam)."""

    made: list[str] = field(default_factory=list)
    retired: list[str] = field(default_factory=list)
    taken: set[str] = field(default_factory=set)  # claimed elsewhere meanwhile
    full: bool = False
    dead: set[str] = field(default_factory=set)  # desktops whose session died
    broken: set[str] = field(default_factory=set)  # retire fails (not a CorralError)
    admission: Any = None

    def __post_init__(self) -> None:
        self.admission = self

    def earlier(self, key: str | None) -> str | None:
        return None

    def resolve_layers(self, req: CreateSandbox) -> list[Layer]:
        return [Layer("sha256:" + req.image.replace(":", "").ljust(64, "0")[:64])]

    async def create(self, req: CreateSandbox) -> Info:
        self.made.append(f"w{len(self.made)}")
        return Info(self.made[-1])

    async def claim(self, sandbox_id: str, req: CreateSandbox) -> Info:
        if self.full:
            raise NodeFull("full", node="n", reason="memory")
        if sandbox_id in self.taken:
            raise NotWarm(sandbox_id)
        if sandbox_id in self.dead:  # the real claim closes it, then raises
            self.retired.append(sandbox_id)
            raise SandboxFailed(f"sandbox {sandbox_id}: its desktop no longer answers")
        return Info(sandbox_id)

    async def retire(self, sandbox_id: str, reason: str) -> None:
        if sandbox_id in self.broken:
            raise OSError(5, "Input/output error")
        self.retired.append(sandbox_id)


def req(image: str = "a:1", display: str | None = None) -> CreateSandbox:
    return validated(CreateSandbox, {"image": image, "display_size": display})


async def settle(pool: WarmPool) -> None:
    for _ in range(100):
        await asyncio.sleep(0)
        if not any(pool._making.values()) and not pool._wake.is_set():
            return


async def test_the_pool_grows_to_demand_within_its_size_and_hands_each_out_once() -> None:
    life = FakeLifecycle()
    pool = WarmPool(NodeConfig(warm_pool=3), life)  # type: ignore[arg-type]
    assert await pool.claim(req()) is None  # nothing warm yet: created cold
    await settle(pool)
    assert life.made == ["w0"]  # one asked for in the last minute: one warm
    pool.expect(req(), 10)
    await settle(pool)
    assert pool.held() == 3 == len(life.made)  # bounded by warm_pool
    got = [await pool.claim(req()) for _ in range(3)]
    assert [g.id for g in got if g] == ["w0", "w1", "w2"]
    await settle(pool)
    assert pool.held() == 3 and len(set(life.made)) == len(life.made)
    await pool.aclose()
    assert sorted(life.retired) == ["w3", "w4", "w5"] and pool.held() == 0


async def test_one_that_will_not_close_leaves_none_of_the_rest_alive() -> None:
    life = FakeLifecycle(broken={"w0"})
    pool = WarmPool(NodeConfig(warm_pool=3), life)  # type: ignore[arg-type]
    pool.expect(req(), 3)
    await settle(pool)
    assert pool.held() == 3
    await pool.aclose()
    assert sorted(life.retired) == ["w1", "w2"] and pool.held() == 0


async def test_a_taken_sandbox_is_skipped_and_a_full_node_keeps_it_warm() -> None:
    life = FakeLifecycle()
    pool = WarmPool(NodeConfig(warm_pool=2), life)  # type: ignore[arg-type]
    pool.expect(req(), 2)
    await settle(pool)
    life.taken.add("w0")
    assert (await pool.claim(req())).id == "w1"  # type: ignore[union-attr]
    await settle(pool)
    life.full = True
    with pytest.raises(NodeFull):
        await pool.claim(req())
    assert pool.held() == 2  # the refused claim's sandbox went back
    await pool.aclose()


async def test_other_kinds_and_an_off_pool_are_never_warm() -> None:
    life = FakeLifecycle()
    off = WarmPool(NodeConfig(warm_pool=0), life)  # type: ignore[arg-type]
    assert await off.claim(req()) is None and off._task is None
    on = WarmPool(NodeConfig(warm_pool=2), life)  # type: ignore[arg-type]
    vm = validated(CreateSandbox, {"image": "a:1", "kind": "microvm"})
    assert await on.claim(vm) is None and on._task is None
    assert life.made == []


async def test_desktops_are_warm_per_screen_size_and_a_dead_one_is_passed_over() -> None:
    life = FakeLifecycle()
    pool = WarmPool(NodeConfig(warm_pool=4), life)  # type: ignore[arg-type]
    pool.expect(req(display="800x600"), 2)
    await settle(pool)
    assert pool.held() == 2
    # Another size, or no display, is another stack: nothing warm for it.
    assert await pool.claim(req(display="1024x768")) is None
    assert await pool.claim(req()) is None
    life.dead.add("w0")
    got = await pool.claim(req(display="800x600"))
    assert got is not None and got.id == "w1"  # w0 closed by its claim, not handed out
    assert life.retired == ["w0"]
    await pool.aclose()


@pytest.mark.parametrize("value", [-1, 5000])
def test_a_pool_size_out_of_range_is_refused(value: int) -> None:
    from corral.errors import InvalidArgument

    with pytest.raises(InvalidArgument) as exc:
        NodeConfig(warm_pool=value)
    assert exc.value.field == "warm_pool" and "max_sandboxes" in exc.value.rule


async def test_a_refill_that_will_not_stop_leaves_none_of_the_pool_alive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A refill that ignores its cancel (stuck in a create) is left behind,
    its stack logged; the warm sandboxes are closed all the same."""
    monkeypatch.setattr("corral.node.warmpool.STOP_WAIT", 0.05, raising=False)
    stuck, freed = asyncio.Event(), asyncio.Event()

    class Stuck(FakeLifecycle):
        async def create(self, req: CreateSandbox) -> Info:
            if len(self.made) == 2:
                stuck.set()
                while not freed.is_set():  # swallows every cancel
                    try:
                        await freed.wait()
                    except asyncio.CancelledError:
                        continue
            return await super().create(req)

    life = Stuck()
    pool = WarmPool(NodeConfig(warm_pool=3), life)  # type: ignore[arg-type]
    pool.expect(req(), 3)
    await stuck.wait()
    refill = pool._task
    assert refill is not None
    logged: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(
        "corral.node.warmpool.log.error", lambda event, **kw: logged.append((event, kw))
    )
    async with asyncio.timeout(5):
        await pool.aclose()
    assert sorted(life.retired) == ["w0", "w1"]
    assert [e for e, _ in logged] == ["warm_pool.refill_did_not_stop"]
    assert "create" in logged[0][1]["stack"]
    freed.set()  # the left-behind task ends before the loop does
    while not refill.done():
        refill.cancel()
        await asyncio.wait({refill}, timeout=0.01)


async def test_a_cancel_a_create_turns_into_its_own_error_still_stops_the_refill(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A create that fails when cancelled (its cleanup raises a CorralError
    of its own) must not leave the refill waiting for demand: aclose
    returns at once, nothing logged."""
    started = asyncio.Event()

    class Converting(FakeLifecycle):
        async def create(self, req: CreateSandbox) -> Info:
            if len(self.made) == 1:
                started.set()
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    raise SandboxFailed("create failed: CancelledError") from None
            return await super().create(req)

    life = Converting()
    pool = WarmPool(NodeConfig(warm_pool=3), life)  # type: ignore[arg-type]
    pool.expect(req(), 3)
    await started.wait()
    logged: list[str] = []
    monkeypatch.setattr("corral.node.warmpool.log.error", lambda event, **kw: logged.append(event))
    async with asyncio.timeout(2):
        await pool.aclose()
    assert life.retired == ["w0"]
    assert logged == []
