"""Rollout logs: each rollout's steps, append-only, in the state store
(the node's SQLite embedded and behind `corral serve`, PostgreSQL behind a
gateway). Written once over corral.db, so both behave the same.

Invariant: a rollout's steps are 0..n-1 with no gap; a step, once logged,
never changes. Appending step n again with the same digest is a no-op (a
retried request); with another digest it is refused, because two writers
(a trainer restarted while its old self still ran) disagree about history.
"""

from __future__ import annotations

import builtins
import json

from corral import metrics
from corral.api.models import ROLLOUT_NAME, ROLLOUT_NAME_RULE, RolloutStep
from corral.db import Database
from corral.errors import Conflict, InvalidArgument

# The same table in both stores (node/store.py migration 7, control/schema.py
# migration 2): part of released migrations, so never edited.
DDL = """CREATE TABLE rollout_steps (
        project TEXT NOT NULL,
        rollout TEXT NOT NULL,
        step    INTEGER NOT NULL,
        op      TEXT NOT NULL,
        digest  TEXT NOT NULL,
        result  TEXT NOT NULL,
        at      DOUBLE PRECISION NOT NULL,
        PRIMARY KEY (project, rollout, step)
    )"""


def check_name(rollout: str) -> str:
    if not ROLLOUT_NAME.fullmatch(rollout):
        raise InvalidArgument("rollout", ROLLOUT_NAME_RULE, rollout)
    return rollout


class StepLog:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def steps(self, project: str, rollout: str) -> builtins.list[RolloutStep]:
        check_name(rollout)
        async with self.db.transaction() as tx:
            rows = await tx.fetchall(
                "SELECT step, op, digest, result, at FROM rollout_steps "
                "WHERE project = %s AND rollout = %s ORDER BY step",
                (project, rollout),
            )
        return [
            RolloutStep(step=s, op=op, digest=d, result=json.loads(r), at=at)
            for s, op, d, r, at in rows
        ]

    async def append(self, project: str, rollout: str, step: RolloutStep) -> None:
        check_name(rollout)
        async with self.db.transaction() as tx:
            row = await tx.fetchone(
                "SELECT COALESCE(MAX(step) + 1, 0) FROM rollout_steps "
                "WHERE project = %s AND rollout = %s",
                (project, rollout),
            )
            n = int(row[0]) if row else 0
            if step.step < n:
                got = await tx.fetchone(
                    "SELECT op, digest FROM rollout_steps "
                    "WHERE project = %s AND rollout = %s AND step = %s",
                    (project, rollout, step.step),
                )
                if got is not None and (got[0], got[1]) == (step.op, step.digest):
                    metrics.ROLLOUT_STEPS.labels("retried").inc()
                    return  # a retry of what is logged
                raise Conflict(
                    f"rollout {rollout!r}: step {step.step} is already logged as "
                    f"{got[0] if got else '?'} with other arguments (another writer?)",
                    rollout=rollout,
                    step=step.step,
                )
            if step.step > n:
                raise InvalidArgument(
                    "step", f"must be the rollout's next step ({n}): steps have no gaps", step.step
                )
            await tx.execute(
                "INSERT INTO rollout_steps (project, rollout, step, op, digest, result, at) "
                "VALUES (%s, %s, %s, %s, %s, %s, $NOW)",
                (project, rollout, step.step, step.op, step.digest, json.dumps(step.result)),
            )
        metrics.ROLLOUT_STEPS.labels("logged").inc()

    async def delete(self, project: str, rollout: str) -> None:
        check_name(rollout)
        async with self.db.transaction() as tx:
            await tx.execute(
                "DELETE FROM rollout_steps WHERE project = %s AND rollout = %s",
                (project, rollout),
            )
