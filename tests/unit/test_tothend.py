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


async def test_changes_of_one_sandbox_take_turns_and_others_do_not_wait() -> None:
    """A fork's save and a suspend of one sandbox never run at once; a
    failed change does not stop the next; another sandbox's runs beside."""
    changes, steps = ToTheEnd(), list[str]()
    gates = {name: asyncio.Event() for name in ("save", "suspend", "other")}

    async def change(name: str, fail: bool = False) -> str:
        steps.append(f"{name} begun")
        await gates[name].wait()
        steps.append(f"{name} ended")
        if fail:
            raise RuntimeError(name)
        return name

    assert not changes.busy("s1")
    save = asyncio.create_task(changes.finish("s1", change("save", fail=True)))
    suspend = asyncio.create_task(changes.run("s1", change("suspend")))
    other = asyncio.create_task(changes.run("s2", change("other")))
    for _ in range(5):
        await asyncio.sleep(0)
    assert steps == ["save begun", "other begun"]
    assert changes.busy("s1") and changes.busy("s2") and not changes.busy("s3")
    gates["suspend"].set()  # ready, and still waits for its turn
    waiter = asyncio.create_task(changes.wait("s1"))
    for _ in range(5):
        await asyncio.sleep(0)
    assert steps == ["save begun", "other begun"] and not waiter.done()
    gates["save"].set()
    with pytest.raises(RuntimeError, match="save"):
        await save
    assert await suspend == "suspend"
    assert await waiter is True  # it waited for both
    assert steps == ["save begun", "other begun", "save ended", "suspend begun", "suspend ended"]
    assert not changes.busy("s1")  # both of its changes ended
    gates["other"].set()
    assert await other == "other"
    assert not changes.busy("s2")
