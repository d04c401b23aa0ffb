"""A create request from the SDK's keyword arguments (sandboxes.create,
create_many, a rollout's create): one place for their defaults."""

from __future__ import annotations

from typing import Any

from corral.api.models import CreateSandbox, NetworkPolicy, validated


def create_request(
    *,
    kind: str = "container",
    image: str,
    workspace: str | None = None,
    toolkit: str | list[str] | None = None,
    cpu: float | None = None,
    memory: int | str | None = None,
    disk: int | str = "2GiB",
    pids: int = 512,
    ttl: float | None = 3600,
    idle_timeout: float | None = 600,
    on_expiry: str = "close",
    env: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    network: NetworkPolicy | dict[str, Any] | None = None,
    display_size: str | tuple[int, int] | None = None,
    protected: list[str] | None = None,
    cpu_class: str = "interactive",
    firmware: str | None = None,
) -> CreateSandbox:
    # cpu, memory, display_size: None is the kind's default (a full VM's is
    # bigger), so they are left out rather than sent as a value.
    optional = {"cpu": cpu, "memory": memory, "display_size": display_size}
    return validated(
        CreateSandbox,
        {
            **{k: v for k, v in optional.items() if v is not None},
            "kind": kind,
            "image": image,
            "workspace": workspace,
            "toolkit": toolkit,
            "disk": disk,
            "pids": pids,
            "ttl": ttl,
            "idle_timeout": idle_timeout,
            "on_expiry": on_expiry,
            "env": env or {},
            "labels": labels or {},
            "network": network.model_dump() if isinstance(network, NetworkPolicy) else network,
            "protected": protected or [],
            "cpu_class": cpu_class,
            "firmware": firmware,
        },
    )
