"""The sandbox state machine (node/states.py) and its enforcement by the
store: a change the table lacks is refused before it reaches SQLite."""

from __future__ import annotations

from pathlib import Path

import pytest

from corral.api.models import SandboxState as S
from corral.node import states
from corral.node.store import SandboxRecord, Store


def _record(sid: str, state: str) -> SandboxRecord:
    return SandboxRecord(
        id=sid, kind="container", state=state, spec={"memory": 1}, layers=[], image_env=[],
        workdir="/", created_at=0.0, expires_at=None, last_active=0.0, owner="1:1",
    )  # fmt: skip


def test_every_state_has_a_row_and_only_final_states_have_no_way_out() -> None:
    assert set(states.TRANSITIONS) == set(S)
    for state, nexts in states.TRANSITIONS.items():
        assert (not nexts) == (state in states.FINAL), state


def test_every_active_state_can_be_closed_and_every_path_ends() -> None:
    for state in S:
        if state not in states.FINAL:
            assert S.closing in states.TRANSITIONS[state], state
    # From any state, the final states are reachable.
    for start in S:
        seen, todo = {start}, [start]
        while todo:
            for nxt in states.TRANSITIONS[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        assert start in states.FINAL or seen >= states.FINAL, start


@pytest.mark.parametrize(
    ("frm", "to"),
    [("closed", "running"), ("failed", "closing"), ("creating", "closed"), ("running", "resuming"),
     ("suspended", "running"), ("running", "creating")],
)  # fmt: skip
def test_the_store_refuses_a_change_the_table_lacks(tmp_path: Path, frm: str, to: str) -> None:
    db = Store(tmp_path / "node.db")
    db.insert(_record("n-1", frm))
    with pytest.raises(ValueError, match=f"{frm} -> {to}"):
        db.transition("n-1", [frm], to)
    assert db.get("n-1").state == frm  # type: ignore[union-attr]


def test_a_change_happens_once_and_only_from_the_named_state(tmp_path: Path) -> None:
    db = Store(tmp_path / "node.db")
    db.insert(_record("n-1", "running"))
    assert db.transition("n-1", ["running", "suspended"], "closing")
    assert not db.transition("n-1", ["running", "suspended"], "closing")  # the loser
    assert db.transition("n-1", ["closing"], "closed", closed_at=1.0)
    rec = db.get("n-1")
    assert rec is not None and rec.state == "closed" and rec.closed_at == 1.0


def test_update_cannot_change_a_state(tmp_path: Path) -> None:
    db = Store(tmp_path / "node.db")
    db.insert(_record("n-1", "running"))
    with pytest.raises(ValueError, match="transition"):
        db.update("n-1", state="closed")
