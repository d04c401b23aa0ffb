"""A cluster's API keys, managed by their holders (through a gateway).

    made = await client.keys.create(project="rl-job-7", expires="12h", note="run 7")
    made.api_key                  # shown once: hand it to the job
    await client.keys.revoke(made.id)

A key makes keys for its own project and those below it, and never one that
outlives itself; it lists and revokes theirs too. A node's own server has
one key, given at start, and refuses these calls.
"""

from __future__ import annotations

import builtins
from collections.abc import Awaitable, Callable

from corral.api.models import ApiKey, CreateKey, validated
from corral.api.service import SandboxService
from corral.errors import InvalidArgument
from corral.units import parse_duration


class AsyncKeys:
    def __init__(self, ready: Callable[[], Awaitable[SandboxService]]) -> None:
        # The client's service, started on first use (AsyncClient._ready).
        self._ready = ready

    async def create(
        self, *, project: str | None = None, expires: str | float | None = None, note: str = ""
    ) -> ApiKey:
        """A new key for `project` (default: the caller's own) that stops
        working after `expires` (seconds, or a duration such as '12h' or
        '30d'; default: never, or when the caller's own key does). The
        answer's `api_key` is the key: it is shown this once."""
        if isinstance(expires, str):
            seconds = parse_duration(expires)
            if seconds is None:
                raise InvalidArgument(
                    "expires", "must be seconds or a duration like '90m', '12h' or '30d'", expires
                )
            expires = float(seconds)
        req = validated(CreateKey, {"project": project, "expires_in": expires, "note": note})
        return await (await self._ready()).create_key(req)

    async def list(self, project: str | None = None) -> builtins.list[ApiKey]:
        """The keys of the caller's project and those below it (of
        `project` only, if given): ids, life and last use, never keys."""
        return await (await self._ready()).list_keys(project or "")

    async def revoke(self, key_id: str) -> ApiKey:
        """Revoke a key by its id (every gateway refuses it within 5 s)."""
        if key_id.startswith("ck_"):  # a URL would carry it into logs and traces
            raise InvalidArgument("key_id", "must be a key's id, not the key", "ck_...")
        return await (await self._ready()).revoke_key(key_id)
