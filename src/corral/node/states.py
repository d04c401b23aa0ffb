"""The sandbox state machine, as the node's store enforces it.

    creating --> running --> suspending --> suspended --> resuming --> running
                    ^            |              ^             |
                    +------------+ (failed)     +-------------+ (failed)
    creating, running, suspending, suspended, resuming --> closing
    closing --> closed | failed;  creating --> failed

Every state change is a conditional UPDATE through `Store.transition`,
which refuses (ValueError: a bug, not a caller's error) any change this
table does not list. Because the UPDATE is conditional on the state it
leaves, two processes racing for one change see exactly one winner: that
is what makes "exactly one closer releases the resources" true.

- creating: recorded and admitted; resources being made. The owner (one
  agent process) is the only one that may move it to running.
- running: serves requests. suspending/resuming: one request holds the
  change (a second waits for it or is refused as busy).
- suspended: on disk, no process; the next request resumes it.
- closing: its resources are being released (by whoever won the change).
- closed / failed: final. The record stays (audit, idempotency) until gc
  purges it an hour later.
"""

from __future__ import annotations

from corral.api.models import SandboxState as S

TRANSITIONS: dict[S, frozenset[S]] = {
    S.creating: frozenset({S.running, S.closing, S.failed}),
    S.running: frozenset({S.suspending, S.closing}),
    S.suspending: frozenset({S.suspended, S.running, S.closing}),
    S.suspended: frozenset({S.resuming, S.closing}),
    S.resuming: frozenset({S.running, S.suspended, S.closing}),
    # closing -> closing: recovery takes over a close whose agent died.
    S.closing: frozenset({S.closing, S.closed, S.failed}),
    S.closed: frozenset(),
    S.failed: frozenset(),
}

FINAL = frozenset({S.closed, S.failed})
ACTIVE = tuple(s.value for s in S if s not in FINAL)
ALL = tuple(s.value for s in S)


def allowed(from_state: str, to_state: str) -> bool:
    return S(to_state) in TRANSITIONS[S(from_state)]


def check(from_states: list[str], to_state: str) -> None:
    """Raise ValueError unless every from -> to is in the table."""
    to = S(to_state)
    for f in from_states:
        if to not in TRANSITIONS[S(f)]:
            raise ValueError(f"no transition {f} -> {to_state} in the sandbox state machine")
