"""Rollouts: the trajectory log (client.rollouts, sdk/rollouts.py) and the
jobs that drive sandboxes with it (the demo, the preemption trainer)."""

from corral.sdk.rollouts import (
    AsyncRollout,
    AsyncRolloutCommands,
    AsyncRolloutFiles,
    AsyncRollouts,
    AsyncRolloutSandbox,
)

__all__ = [
    "AsyncRollout",
    "AsyncRolloutCommands",
    "AsyncRolloutFiles",
    "AsyncRolloutSandbox",
    "AsyncRollouts",
]
