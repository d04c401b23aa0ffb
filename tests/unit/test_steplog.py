"""Rollout logs on a real SQLite file: append-only, no gaps, a retry is a
no-op, another writer's history is refused, projects apart."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.api.models import ExecRequest, RolloutStep
from corral.db import SqliteDatabase
from corral.errors import Conflict, InvalidArgument
from corral.node import keyed, steplog

A, B = "a" * 64, "b" * 64


@pytest.fixture
async def log(tmp_path: Path) -> steplog.StepLog:
    db = SqliteDatabase(f"sqlite://{tmp_path / 'log.db'}", inline=True)
    async with db.transaction() as tx:
        await tx.execute(steplog.DDL)
    return steplog.StepLog(db)


async def test_steps_append_in_order_and_read_back(log: steplog.StepLog) -> None:
    for i in range(3):
        await log.append("p", "r1", RolloutStep(step=i, op="x", digest=A, result={"v": i}))
    got = await log.steps("p", "r1")
    assert [(s.step, s.result) for s in got] == [(0, {"v": 0}), (1, {"v": 1}), (2, {"v": 2})]
    assert all(s.at > 0 for s in got)
    assert await log.steps("other-project", "r1") == []


@pytest.mark.parametrize(
    ("step", "digest", "error", "field"),
    [
        (5, A, InvalidArgument, "step"),  # a gap
        (1, B, Conflict, None),  # step 1 logged with other arguments
    ],
)
async def test_bad_appends_are_refused_and_change_nothing(
    log: steplog.StepLog, step: int, digest: str, error: type, field: str | None
) -> None:
    for i in range(2):
        await log.append("p", "r", RolloutStep(step=i, op="x", digest=A))
    with pytest.raises(error) as err:
        await log.append("p", "r", RolloutStep(step=step, op="x", digest=digest))
    if field:
        assert err.value.field == field
    assert [s.digest for s in await log.steps("p", "r")] == [A, A]


async def test_a_retried_append_is_a_no_op(log: steplog.StepLog) -> None:
    step = RolloutStep(step=0, op="x", digest=A, result=1)
    await log.append("p", "r", step)
    await log.append("p", "r", step)
    assert len(await log.steps("p", "r")) == 1
    await log.delete("p", "r")
    assert await log.steps("p", "r") == []


@pytest.mark.parametrize("name", ["", "a/b", "../x", "x" * 129, "sp ace"])
async def test_bad_rollout_names_are_refused(log: steplog.StepLog, name: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        await log.steps("p", name)
    assert err.value.field == "rollout"


@pytest.mark.parametrize(
    ("fields", "field"),
    [({"step": -1}, "step"), ({"digest": "zz"}, "digest"), ({"op": ""}, "op")],
)
def test_bad_steps_are_refused(fields: dict[str, object], field: str) -> None:
    from corral.api.models import validated

    with pytest.raises(InvalidArgument) as err:
        validated(RolloutStep, {"step": 0, "op": "x", "digest": A, **fields})
    assert err.value.field == field


def test_a_keyed_commands_digest_ignores_its_key_only() -> None:
    a = keyed.digest(ExecRequest(cmd="echo 1", key="k1"))
    assert a == keyed.digest(ExecRequest(cmd="echo 1", key="k2"))
    assert a != keyed.digest(ExecRequest(cmd="echo 2", key="k1"))
    assert a != keyed.digest(ExecRequest(cmd="echo 1", key="k1", timeout=5))
