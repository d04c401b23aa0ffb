"""Labels the platform sets on sandboxes. Callers cannot set them (the
request models refuse `corral.pool`; the gateway refuses every one of
RESERVED), so a label here always means what its comment says."""

from __future__ import annotations

PREFIX = "corral."
PROJECT = "corral.project"  # the project that owns it (set by the gateway; on a
# layer, set by the node on a commit of such a sandbox: ImageStore.for_project)
KEY = "corral.key"  # the gateway's idempotency key for its row
POOL = "corral.pool"  # one of the node's own function-call workers
FORKED_FROM = "corral.forked_from"  # on each fork copy: the id of its source
RESTORED_FROM = "corral.restored_from"  # on a restored VM: the id it was saved from

# A sandbox's own secrets: whoever holds one reaches that sandbox (E2B's
# envd, and its ports), so every copy (a fork's, a restore's) gets new ones.
E2B_TOKEN = "corral.e2b_token"
E2B_TRAFFIC_TOKEN = "corral.e2b_traffic_token"
SECRETS = (E2B_TOKEN, E2B_TRAFFIC_TOKEN)


def without_secrets(tags: dict[str, str]) -> dict[str, str]:
    """`tags` with each secret's value blanked, for everywhere but the
    sandbox's own record: events, saved state, pages. The key stays, so a
    copy made from it still knows to get fresh ones."""
    if not any(k in tags for k in SECRETS):
        return tags
    return {k: ("" if k in SECRETS else v) for k, v in tags.items()}


# Refused in a caller's create through a gateway.
RESERVED = (PROJECT, KEY, POOL)
ROLLOUT = "corral.rollout"  # on each sandbox a rollout created: the rollout's name


# Where a cluster project's own images are named: only it may write or read
# names under it (control/project_images.py).
PROJECT_IMAGES = "projects/"


def own_images(project: str) -> str:
    """The prefix of `project`'s own image names."""
    return f"{PROJECT_IMAGES}{project}/"
