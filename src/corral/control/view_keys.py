"""A gateway view's API keys: its holder makes, lists and revokes the keys
of its project and of the projects below it (control/keys.py has the
rules). Apart from control/view.py, which is the sandboxes'."""

from __future__ import annotations

import builtins
import time
from collections.abc import AsyncIterator

from corral.api.models import ApiKey, CreateKey, Event
from corral.control import keys
from corral.control.core import GatewayCore
from corral.errors import Unauthenticated


def _wire(info: keys.KeyInfo, key: str | None = None) -> ApiKey:
    return ApiKey(**info.__dict__, api_key=key)


class KeyOps:
    """Mixed into GatewayView, which sets these."""

    gw: GatewayCore
    grant: keys.Grant | None  # None: a view made for a sandbox's token, not a key
    project: str

    def _grant(self) -> keys.Grant:
        if self.grant is None:
            raise Unauthenticated("API keys are managed with an API key, not a sandbox's token")
        return self.grant

    async def create_key(self, req: CreateKey) -> ApiKey:
        key, info = await keys.mint(
            self.gw.db, self._grant(), req.project, req.expires_in, req.note
        )
        return _wire(info, key)

    async def list_keys(self, project: str = "") -> builtins.list[ApiKey]:
        return [
            _wire(k) for k in await keys.list_within(self.gw.db, self._grant().project, project)
        ]

    def _within_key(self, ttl: int) -> int:
        """A token's life, cut to end with the key that asks for it (the
        token is checked without the key, which may expire first)."""
        if self.grant is None or self.grant.expires_at is None:
            return ttl
        return max(1, min(ttl, int(self.grant.expires_at - time.time())))

    async def _rechecked(self, stream: AsyncIterator[Event]) -> AsyncIterator[Event]:
        """`stream`, ended (Unauthenticated) at its first event after its key
        was revoked or expired: a request's key is checked once, and a
        stream may run for days."""
        checked = time.monotonic()
        try:
            async for event in stream:
                grant = self.grant
                if grant is not None and (
                    time.monotonic() - checked >= keys.RECHECK or grant.expired(time.time())
                ):
                    await keys.check_hash(self.gw.db, grant.key_hash)
                    checked = time.monotonic()
                yield event
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def revoke_key(self, key_id: str) -> ApiKey:
        info, also = await keys.revoke_key(self.gw.db, key_id, within=self._grant().project)
        for gone in (info.id, *also):
            self.gw.forget_key(gone)
        return ApiKey(**info.__dict__, also_revoked=also)
