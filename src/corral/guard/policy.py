"""A sandbox's network policy: where it may connect. Defined here, with
the guard that enforces it (guard/network.py, guard/dns.py); the API
re-exports it (corral.api.models.NetworkPolicy) as a request field."""

from __future__ import annotations

import ipaddress
import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

_DOMAIN = re.compile(
    r"^(\*\.)?([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"
)


class NetworkPolicy(BaseModel):
    """Where a sandbox may connect. Everything else is refused (and counted).

    `domains` are names the sandbox may resolve and reach ("*.example.com"
    covers subdomains); `cidrs` are addresses it may reach without DNS;
    `ports` restricts both (empty: any port); `ecosystems` turn on named
    package sources ({"pypi": True}), mapped to hosts by node configuration.
    """

    model_config = ConfigDict(extra="forbid")

    domains: list[str] = Field(default_factory=list)
    cidrs: list[str] = Field(default_factory=list)
    ports: list[int] = Field(default_factory=lambda: [80, 443])
    ecosystems: dict[str, bool] = Field(default_factory=dict)

    @field_validator("domains")
    @classmethod
    def _domains(cls, v: list[str]) -> list[str]:
        if len(v) > 256:
            raise ValueError("at most 256 domains")
        out = []
        for d in v:
            d = d.lower().rstrip(".")
            if len(d) > 253 or not _DOMAIN.match(d):
                raise ValueError(f"{d!r} must be a host name, optionally starting with '*.'")
            out.append(d)
        return out

    @field_validator("cidrs")
    @classmethod
    def _cidrs(cls, v: list[str]) -> list[str]:

        if len(v) > 256:
            raise ValueError("at most 256 CIDRs")
        out = []
        for c in v:
            try:
                net = ipaddress.ip_network(c, strict=False)
            except ValueError:
                raise ValueError(f"{c!r} must be an IPv4 address or CIDR") from None
            if net.version != 4:
                raise ValueError(f"{c!r} must be IPv4 (sandboxes have no IPv6)")
            out.append(str(net))
        return out

    @field_validator("ports")
    @classmethod
    def _ports(cls, v: list[int]) -> list[int]:
        if len(v) > 64 or any(not 1 <= p <= 65535 for p in v):
            raise ValueError("must be at most 64 ports between 1 and 65535")
        return sorted(set(v))
