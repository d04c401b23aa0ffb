"""The SDK's HTTP transport, now corral.api.http (generated from the route
table): re-exported for corral.cluster.up, which imports it from here."""

from corral.api.http import HttpService

__all__ = ["HttpService"]
