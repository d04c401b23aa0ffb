"""Rollouts as durable step logs: fast-forward resume, commands at most
once per key (also when the caller vanished mid-command), replays that
disagree with the log refused."""

from __future__ import annotations

import asyncio
import secrets

import httpx
import pytest

import corral
from corral.api.models import ExecRequest
from corral.node import keyed

from ..framework import IMAGE, Node, Server

BUMP = "n=$(cat /tmp/n 2>/dev/null || echo 0); echo $((n+1)) > /tmp/n; cat /tmp/n"


def _name() -> str:
    return f"r-{secrets.token_hex(6)}"


async def test_a_keyed_command_runs_once(client: corral.AsyncClient) -> None:
    sbx = await client.sandboxes.create(image=IMAGE, memory="64MiB")
    first = await sbx.commands.run(BUMP, key="k1")
    again = await sbx.commands.run(BUMP, key="k1")
    assert first.stdout == again.stdout == "1\n"
    assert (await sbx.commands.run(BUMP, key="k2")).stdout == "2\n"
    with pytest.raises(corral.InvalidArgument) as err:
        await sbx.commands.run("echo other", key="k1")
    assert err.value.field == "key"
    # Waiting on a key that is still running: both get the one run.
    both = await asyncio.gather(
        sbx.commands.run(f"sleep 0.5; {BUMP}", key="k3"),
        sbx.commands.run(f"sleep 0.5; {BUMP}", key="k3"),
    )
    assert [r.stdout for r in both] == ["3\n", "3\n"]
    with pytest.raises(corral.InvalidArgument, match="key"):
        await sbx.commands.run("true", key="bad key with spaces")
    # Its output is recorded for replays: caps past RECORDED_MAX are refused,
    # before the key is spent.
    with pytest.raises(corral.InvalidArgument, match="at most 33554432 bytes") as err:
        await sbx.commands.run("echo big", key="k4", stdout_limit=64 << 20)
    assert err.value.field == "stdout_limit"
    assert (await sbx.commands.run("echo big", key="k4")).stdout == "big\n"
    await sbx.close()


async def test_a_keyed_command_finishes_when_its_caller_is_gone(node: Node, server: object) -> None:
    """A trainer killed mid-command: the node runs it to its end and keeps
    the result for the trainer's next life."""
    async with node.http_client() as c:
        sbx = await c.sandboxes.create(image=IMAGE, memory="64MiB")
        call = asyncio.create_task(sbx.commands.run(f"sleep 1; {BUMP}", key="late"))
        await asyncio.sleep(0.4)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    async with node.http_client() as c:
        again = await (await c.sandboxes.get(sbx.id)).commands.run(f"sleep 1; {BUMP}", key="late")
        assert again.stdout == "1\n"
        assert (await (await c.sandboxes.get(sbx.id)).files.read_text("/tmp/n")) == "1\n"
        await c._service.close(sbx.id)  # type: ignore[attr-defined]


async def test_a_key_lost_with_its_agent_is_ambiguous(fresh_node: Node) -> None:
    async with fresh_node.client() as c:
        sbx = await c.sandboxes.create(image=IMAGE, memory="64MiB")
        # The agent's record says started, with no end: its agent died.
        want = keyed.digest(ExecRequest(cmd="true", key="lost"))
        fresh_node.agent.parts.store.exec_key_start(sbx.id, "lost", want)
        with pytest.raises(corral.Ambiguous):
            await sbx.commands.run("true", key="lost")
        await sbx.close()


async def _trajectory(c: corral.AsyncClient, name: str, stop_at: int | None) -> list[str]:
    r = await c.rollouts.open(name)
    sbx = await r.create(image=IMAGE, memory="64MiB", labels={"rollout": name})
    out = []
    for i in range(6):
        if stop_at is not None and r.step >= stop_at:
            raise RuntimeError("trainer died")
        res = await sbx.commands.run(BUMP)
        seen = res.stdout.strip()
        action = await r.record("policy", lambda i=i, seen=seen: {"i": i, "seen": seen})
        out.append(f"{res.stdout.strip()}:{action['i']}")
    await sbx.files.write("/tmp/done", "yes")
    out.append(await sbx.files.read_text("/tmp/done"))
    return out


async def test_a_restarted_trainer_fast_forwards(client: corral.AsyncClient) -> None:
    name = _name()
    with pytest.raises(RuntimeError):
        await _trajectory(client, name, stop_at=7)
    out = await _trajectory(client, name, stop_at=None)
    assert out == [f"{i + 1}:{i}" for i in range(6)] + ["yes"]
    r = await client.rollouts.open(name)
    assert r.logged == 15 and r.replaying
    state = (await client.rollouts.resume({"name": name, "step": 15})).state()
    assert state["name"] == name and state["step"] == 0
    sbx_id = (await client.sandboxes.list(labels={"rollout": name}))[0].id
    again = await client.rollouts.open(name)
    assert (await again.create(image=IMAGE, memory="64MiB", labels={"rollout": name})).id == sbx_id
    assert again.state()["sandboxes"] == [sbx_id]
    await client.rollouts.delete(name)
    assert (await client.rollouts.open(name)).logged == 0
    await (await client.sandboxes.get(sbx_id)).close()


async def test_the_in_flight_step_is_resolved_exactly_once(client: corral.AsyncClient) -> None:
    """The trainer died after the node ran step 1 but before it was logged:
    the restarted trainer gets the node's result, the command does not
    run again."""
    name = _name()
    r = await client.rollouts.open(name)
    sbx = await r.create(image=IMAGE, memory="64MiB")
    ran = await sbx.sandbox.commands.run(BUMP, key=f"{name}.1")  # ran, never logged
    assert ran.stdout == "1\n"
    r2 = await client.rollouts.open(name)
    sbx2 = await r2.create(image=IMAGE, memory="64MiB")
    assert (await sbx2.commands.run(BUMP)).stdout == "1\n"
    assert (await sbx2.commands.run(BUMP)).stdout == "2\n"
    await sbx.sandbox.close()


@pytest.mark.parametrize(
    "replay",
    ["other command", "other op", "other file bytes"],
)
async def test_a_replay_that_disagrees_with_the_log_is_refused(
    client: corral.AsyncClient, replay: str
) -> None:
    name = _name()
    r = await client.rollouts.open(name)
    sbx = await r.create(image=IMAGE, memory="64MiB")
    await sbx.commands.run("echo a")
    await sbx.files.write("/tmp/f", "one")
    r2 = await client.rollouts.open(name)
    sbx2 = await r2.create(image=IMAGE, memory="64MiB")
    with pytest.raises(corral.InvalidArgument) as err:
        if replay == "other command":
            await sbx2.commands.run("echo b")
        elif replay == "other op":
            await sbx2.files.read("/tmp/f")
        else:
            await sbx2.commands.run("echo a")
            await sbx2.files.write("/tmp/f", "two")
    assert err.value.field == "step" and "changed" in err.value.message
    # Nothing was run or logged by the refused replay.
    assert (await client.rollouts.open(name)).logged == 3
    assert (await sbx.sandbox.files.read_text("/tmp/f")) == "one"
    await sbx.sandbox.close()


@pytest.mark.parametrize(
    ("state", "field"),
    [({}, "state.name"), ({"name": "x y"}, "name"), ({"name": "fresh", "step": 5}, "state.step")],
)
async def test_bad_rollout_states_are_refused(
    client: corral.AsyncClient, state: dict[str, object], field: str
) -> None:
    with pytest.raises(corral.InvalidArgument) as err:
        await client.rollouts.resume(state)
    assert err.value.field == field


async def test_a_step_logged_twice_by_two_writers_is_refused(client: corral.AsyncClient) -> None:
    from corral.api.models import RolloutStep

    name = _name()
    service = client._service  # type: ignore[attr-defined]
    await service.rollout_append(name, RolloutStep(step=0, op="a", digest="0" * 64))
    await service.rollout_append(name, RolloutStep(step=0, op="a", digest="0" * 64))  # a retry
    with pytest.raises(corral.Conflict):
        await service.rollout_append(name, RolloutStep(step=0, op="a", digest="1" * 64))
    with pytest.raises(corral.InvalidArgument) as err:
        await service.rollout_append(name, RolloutStep(step=5, op="a", digest="0" * 64))
    assert err.value.field == "step"
    with pytest.raises(corral.InvalidArgument) as err:
        await service.rollout_steps("../etc")
    assert err.value.field == "rollout"
    await service.rollout_delete(name)


async def test_steps_and_suspends_are_counted_in_the_metrics(node: Node, server: Server) -> None:
    async with node.http_client() as c:
        r = await c.rollouts.open(_name())
        sbx = await r.create(image=IMAGE, memory="64MiB")
        await sbx.commands.run("true")
        await sbx.sandbox.commands.run("true", key=f"{r.name}.1")  # a replay of step 1
        await sbx.sandbox.suspend()
        await sbx.sandbox.close()
        await c.rollouts.delete(r.name)
    async with httpx.AsyncClient(
        transport=httpx.AsyncHTTPTransport(uds=str(server.sock)), base_url="http://corral"
    ) as http:
        text = (await http.get("/metrics")).text
    assert 'corral_rollout_steps_total{outcome="logged"}' in text
    assert 'corral_keyed_exec_total{outcome="run"}' in text
    assert 'corral_keyed_exec_total{outcome="replayed"}' in text
    assert 'corral_suspend_seconds_count{kind="container",mode="freeze",op="suspend"}' in text
