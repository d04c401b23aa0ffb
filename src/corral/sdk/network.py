"""A sandbox's egress policy, changed while it runs."""

from __future__ import annotations

from typing import Any

from corral.api.models import NetworkPolicy, SandboxInfo, validated
from corral.sdk.handle import SandboxHandle


class AsyncNetwork:
    def __init__(self, sandbox: SandboxHandle) -> None:
        self._sandbox = sandbox

    @property
    def policy(self) -> NetworkPolicy | None:
        """The policy as of the last refresh (None: no network at all)."""
        return self._sandbox.info.network

    async def update(self, policy: NetworkPolicy | dict[str, Any]) -> SandboxInfo:
        """Replace where the sandbox may connect; takes effect at once, also
        for connections already open. A sandbox created without network
        gets an interface now."""
        if not isinstance(policy, NetworkPolicy):
            policy = validated(NetworkPolicy, {**policy})
        info = await self._sandbox._service.update_network(self._sandbox.id, policy)
        self._sandbox.info = info
        return info
