"""Bad input through the real node, both transports: a clear error naming the
field, the rule and the value, and nothing left behind."""

from __future__ import annotations

from typing import Any

import pytest

import corral

from ..framework import IMAGE, Node

CREATE_CASES: list[tuple[dict[str, Any], type[corral.CorralError], str | None]] = [
    ({"kind": "teleporter"}, corral.InvalidArgument, "kind"),
    ({"image": "no-such-image:1"}, corral.ImageNotFound, None),
    ({"workspace": "no-such-ws:1"}, corral.ImageNotFound, None),
    ({"toolkit": ["pytest:8.3.3", "nope:0"]}, corral.ImageNotFound, None),
    ({"image": "Bad Ref!"}, corral.InvalidArgument, "image"),
    ({"memory": "lots"}, corral.InvalidArgument, "memory"),
    ({"memory": "1TiB"}, corral.ResourceExhausted, None),  # more than the node may promise
    ({"disk": 1}, corral.InvalidArgument, "disk"),
    ({"cpu": -1}, corral.InvalidArgument, "cpu"),
    ({"pids": 10**9}, corral.InvalidArgument, "pids"),
    ({"ttl": -1}, corral.InvalidArgument, "ttl"),
    ({"env": {"NOT VALID": "x"}}, corral.InvalidArgument, "env"),
    ({"labels": {"": "x"}}, corral.InvalidArgument, "labels"),
]


@pytest.mark.parametrize(("change", "error", "field"), CREATE_CASES)
async def test_bad_create_leaves_nothing(
    client: corral.AsyncClient,
    node: Node,
    change: dict[str, Any],
    error: type[corral.CorralError],
    field: str | None,
) -> None:
    before = (node.leftovers(), len(node.records()), len(await client.sandboxes.list()))
    with pytest.raises(error) as exc:
        await client.sandboxes.create(**{"image": IMAGE, **change})
    if field:
        assert isinstance(exc.value, corral.InvalidArgument)
        assert exc.value.field.startswith(field)
        assert field in str(exc.value) and "got" in str(exc.value)
    after = (node.leftovers(), len(node.records()), len(await client.sandboxes.list()))
    assert after == before


async def test_bad_exec_and_file_input(client: corral.AsyncClient) -> None:
    sbx = await client.sandboxes.create(image=IMAGE)
    cases: list[tuple[Any, str]] = [
        (sbx.commands.run("true", timeout=-1), "timeout"),
        (sbx.commands.run(""), "cmd"),
        (sbx.commands.run("true", cwd="relative"), "cwd"),
        (sbx.commands.run("true", user="a b"), "user"),
        (sbx.files.read("../../etc/passwd"), "path"),
        (sbx.files.write("/a/../../etc/passwd", b"x"), "path"),
    ]
    for call, field in cases:
        with pytest.raises(corral.InvalidArgument) as exc:
            await call
        assert exc.value.field == field, str(exc.value)
    await sbx.close()
    for call in (
        sbx.commands.run("true"),
        sbx.files.read("/etc/hostname"),
        sbx.files.write("/x", b"x"),
    ):
        with pytest.raises(corral.SandboxClosed):
            await call


async def test_full_node_refuses_with_a_clear_error(fresh_node: Node) -> None:
    full = fresh_node.with_config(max_sandboxes=2)
    async with full.client() as c:
        a = await c.sandboxes.create(image=IMAGE)
        b = await c.sandboxes.create(image=IMAGE)
        with pytest.raises(corral.ResourceExhausted) as exc:
            await c.sandboxes.create(image=IMAGE)
        assert "max_sandboxes is 2" in exc.value.message
        await a.close()
        await (await c.sandboxes.create(image=IMAGE)).close()
        await b.close()
    assert full.leftovers() == {}
