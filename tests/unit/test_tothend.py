"""node/tothend.py: a change, once begun, runs to its end; its caller's
cancel only stops the wait; a second caller waits for the one in flight."""

from __future__ import annotations

import asyncio

import pytest

from corral.node.tothend import ToTheEnd

pytestmark = pytest.mark.unit


async def test_a_cancelled_caller_stops_waiting_and_the_change_ends() -> None:
    changes, steps = ToTheEnd(), list[str]()
    gate = asyncio.Event()

    async def change() -> str:
        steps.append("begun")
        await gate.wait()
        steps.append("ended")
        return "done"

    caller = asyncio.create_task(changes.run("s1", change()))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert steps == ["begun"]
    waiter = asyncio.create_task(changes.wait("s1"))
    await asyncio.sleep(0)
    assert not waiter.done()  # the change is still in flight
    gate.set()
    assert await waiter is True
    assert steps == ["begun", "ended"]
    assert await changes.wait("s1") is False  # nothing in flight any more


async def test_a_failed_change_is_its_callers_and_is_logged_when_nobody_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    logged: list[tuple[str, dict[str, object]]] = []
    monkeypatch.setattr(
        "corral.node.tothend.log.warning", lambda event, **kw: logged.append((event, kw))
    )
    changes = ToTheEnd()

    async def broken() -> None:
        await asyncio.sleep(0.01)
        raise OSError("the kernel said no")

    with pytest.raises(OSError, match="said no"):
        await changes.run("s1", broken())
    caller = asyncio.create_task(changes.run("s2", broken()))
    await asyncio.sleep(0)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await changes.aclose()  # the change runs on after its caller went
    await asyncio.sleep(0)
    assert [(e, kw["sandbox"]) for e, kw in logged] == [
        ("sandbox.change_failed", "s1"),
        ("sandbox.change_failed", "s2"),
    ]
    assert await changes.wait("s2") is False


async def test_finish_raises_the_cancel_only_once_the_change_ended() -> None:
    changes, steps = ToTheEnd(), list[str]()
    gate = asyncio.Event()

    async def change() -> None:
        await gate.wait()
        steps.append("ended")

    caller = asyncio.create_task(changes.finish("s1", change()))
    await asyncio.sleep(0)
    caller.cancel()
    await asyncio.sleep(0.01)
    assert not caller.done()  # still waiting: the change has not ended
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert steps == ["ended"]
    assert await changes.wait("s1") is False
