"""Bursts: create_many with per-item idempotency keys, partial failures and
a bounded number in flight."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import pytest

import corral

from ..framework import IMAGE, Node


def _spec(tag: str) -> dict[str, Any]:
    return {"image": IMAGE, "memory": "64MiB", "labels": {"burst": tag}}


async def test_a_retried_burst_makes_nothing_twice(client: corral.AsyncClient) -> None:
    tag, key = secrets.token_hex(4), f"job-{secrets.token_hex(4)}"
    ready: list[int] = []
    first = await client.sandboxes.create_many(
        _spec(tag), 6, concurrency=3, key=key, on_ready=lambda i, _r: ready.append(i)
    )
    assert all(isinstance(s, corral.AsyncSandbox) for s in first)
    assert sorted(ready) == list(range(6))
    ids = [s.id for s in first if isinstance(s, corral.AsyncSandbox)]
    assert len(set(ids)) == 6
    # The client lost its answers and retries the whole burst, twice at once.
    again = await asyncio.gather(
        client.sandboxes.create_many(_spec(tag), 6, key=key),
        client.sandboxes.create_many(_spec(tag), 6, key=key),
    )
    for batch in again:
        assert [s.id for s in batch if isinstance(s, corral.AsyncSandbox)] == ids
    listed = await client.sandboxes.list(labels={"burst": tag})
    assert sorted(s.id for s in listed) == sorted(ids)
    # A bigger retry makes only the new items.
    more = await client.sandboxes.create_many(_spec(tag), 8, key=key)
    assert [s.id for s in more[:6] if isinstance(s, corral.AsyncSandbox)] == ids
    assert len(await client.sandboxes.list(labels={"burst": tag})) == 8
    await asyncio.gather(*(s.close() for s in more if isinstance(s, corral.AsyncSandbox)))


async def test_partial_failures_are_reported_per_item(fresh_node: Node) -> None:
    async with fresh_node.with_config(max_sandboxes=3).client() as c:
        out = await c.sandboxes.create_many(_spec("full"), 5, concurrency=1)
        made = [s for s in out if isinstance(s, corral.AsyncSandbox)]
        errors = [e for e in out if isinstance(e, corral.CorralError)]
        assert len(made) == 3 and len(errors) == 2
        assert all(isinstance(e, corral.ResourceExhausted) for e in errors)
        assert "max_sandboxes" in str(errors[0])
        await asyncio.gather(*(s.close() for s in made))


async def test_in_order_when_one_at_a_time(embedded: corral.AsyncClient) -> None:
    order: list[int] = []
    out = await embedded.sandboxes.create_many(
        _spec("serial"), 4, concurrency=1, on_ready=lambda i, _r: order.append(i)
    )
    assert order == [0, 1, 2, 3]
    await asyncio.gather(*(s.close() for s in out if isinstance(s, corral.AsyncSandbox)))


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"count": 0}, "count"),
        ({"count": 10**6}, "count"),
        ({"concurrency": 0}, "concurrency"),
        ({"key": "bad key!"}, "key"),
        ({"spec": {"image": IMAGE, "colour": "red"}}, "spec.colour"),
        ({"spec": {"memory": "1GiB"}}, "spec.image"),
        ({"spec": {"image": IMAGE, "memory": "lots"}}, "memory"),
    ],
)
async def test_bad_bursts_are_refused_before_any_sandbox(
    embedded: corral.AsyncClient, args: dict[str, Any], field: str
) -> None:
    before = len(await embedded.sandboxes.list())
    call: dict[str, Any] = {"spec": _spec("bad"), "count": 2, **args}
    with pytest.raises(corral.InvalidArgument) as exc:
        await embedded.sandboxes.create_many(call.pop("spec"), call.pop("count"), **call)
    assert exc.value.field == field
    assert len(await embedded.sandboxes.list()) == before


def test_the_blocking_twin_returns_sandboxes_and_errors(fresh_node: Node) -> None:
    with corral.Client(config=fresh_node.with_config(max_sandboxes=1).config) as c:
        out = c.sandboxes.create_many(_spec("sync"), 2, concurrency=1)
        assert isinstance(out[0], corral.Sandbox) and isinstance(out[1], corral.ResourceExhausted)
        out[0].close()


async def test_a_burst_survives_its_server_being_killed(fresh_node: Node) -> None:
    key, n = f"kill-{secrets.token_hex(4)}", 24
    srv = fresh_node.server
    srv.start()
    ready = asyncio.Event()
    done: list[int] = []

    def seen(i: int, r: str | corral.CorralError) -> None:
        if isinstance(r, str):
            done.append(i)
        if len(done) >= 6:
            ready.set()

    async with fresh_node.http_client() as c:
        burst = asyncio.create_task(
            c.sandboxes.create_many(
                _spec("kill"), n, concurrency=4, key=key, on_ready=seen, retry_for=0
            )
        )
        async with asyncio.timeout(60):
            await ready.wait()
        srv.kill()  # SIGKILL, mid-burst
        first = await burst
    lost = [r for r in first if isinstance(r, corral.CorralError)]
    assert lost and all(isinstance(e, corral.Unavailable) for e in lost)
    made_before = {r.id for r in first if isinstance(r, corral.AsyncSandbox)}
    srv.start()  # recovers: creates in flight are failed and reclaimed
    async with fresh_node.http_client() as c:
        again = await c.sandboxes.create_many(_spec("kill"), n, concurrency=4, key=key)
        assert all(isinstance(r, corral.AsyncSandbox) for r in again), again
        ids = [r.id for r in again if isinstance(r, corral.AsyncSandbox)]
        assert len(set(ids)) == n and made_before <= set(ids)
        listed = await c.sandboxes.list(labels={"burst": "kill"})
        assert sorted(s.id for s in listed) == sorted(ids)
        await asyncio.gather(*(s.close() for s in listed))
    srv.stop()
    async with fresh_node.client():
        pass  # the last agent out unmounts what nothing needs
    assert fresh_node.leftovers() == {}
