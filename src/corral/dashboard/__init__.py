"""The web dashboard: server-rendered pages over the same service (and key)
as the API, for `corral serve` and the gateway. See docs/dashboard.md."""

from __future__ import annotations

from corral.dashboard.site import add_dashboard

__all__ = ["add_dashboard"]
