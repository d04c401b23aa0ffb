"""Looking sandboxes up: the record of an id, checked for the request at
hand, and its wire view (SandboxInfo)."""

from __future__ import annotations

import builtins
from typing import Any

from corral import ids, labels
from corral.api.models import NetworkPolicy, SandboxInfo, SandboxState
from corral.errors import (
    CorralError,
    InvalidArgument,
    PermissionDenied,
    SandboxClosed,
    SandboxFailed,
    SandboxNotFound,
)
from corral.guard.network import NodeNetwork
from corral.node.activity import Activity
from corral.node.store import ACTIVE_STATES, SandboxRecord, Store


class Records:
    def __init__(self, store: Store, node: str, network: NodeNetwork, activity: Activity) -> None:
        self.store = store
        self.node = node
        self.network = network
        self.activity = activity

    def get(self, sandbox_id: str) -> SandboxRecord:
        if not isinstance(sandbox_id, str) or not sandbox_id:
            raise InvalidArgument("sandbox_id", "must be a non-empty string", sandbox_id)
        rec = self.store.get(sandbox_id)
        if rec is None:
            node = ids.node_of(sandbox_id)
            where = "" if node in (None, self.node) else f" (its id names node {node!r})"
            raise SandboxNotFound(
                f"no sandbox {sandbox_id!r} on node {self.node!r}{where}", sandbox=sandbox_id
            )
        return rec

    @staticmethod
    def not_a_worker(rec: SandboxRecord) -> None:
        if labels.POOL in rec.labels:
            use = "client.fncall" if rec.labels[labels.POOL] == "fncall" else "sandboxes.create"
            raise PermissionDenied(
                f"sandbox {rec.id} is one of the node's pooled sandboxes, not handed out: "
                f"use {use}, not the sandbox API",
                sandbox=rec.id,
            )

    def running(self, sandbox_id: str) -> SandboxRecord:
        """The record of a caller's running sandbox, marked used now."""
        rec = self.get(sandbox_id)
        self.not_a_worker(rec)
        if rec.state != "running":
            if rec.state in ("closed", "closing"):
                raise SandboxClosed(
                    f"sandbox {sandbox_id} is {rec.state}"
                    + (f": {rec.error}" if rec.error else ""),
                    sandbox=sandbox_id,
                )
            if rec.state == "failed":
                raise SandboxFailed(f"sandbox {sandbox_id} failed: {rec.error}", sandbox=sandbox_id)
            raise SandboxClosed(f"sandbox {sandbox_id} is still {rec.state}", sandbox=sandbox_id)
        self.activity.touch(sandbox_id)
        return rec

    def gone(self, sandbox_id: str) -> CorralError:
        """The exec server stopped answering: say why, from the record."""
        rec = self.store.get(sandbox_id)
        if rec is None or rec.state in ("closed", "closing"):
            return SandboxClosed(f"sandbox {sandbox_id} was closed", sandbox=sandbox_id)
        return SandboxFailed(
            f"sandbox {sandbox_id}: lost its exec server (the sandbox died?)", sandbox=sandbox_id
        )

    def info(self, rec: SandboxRecord) -> SandboxInfo:
        s = rec.spec
        return SandboxInfo(
            id=rec.id,
            node=self.node,
            kind=rec.kind,
            state=SandboxState(rec.state),
            image=s["image"],
            workspace=s.get("workspace"),
            toolkit=s.get("toolkit", []),
            layers=rec.layers,
            cpu=s["cpu"],
            memory=s["memory"],
            disk=s["disk"],
            pids=s["pids"],
            ttl=s.get("ttl"),
            idle_timeout=s.get("idle_timeout"),
            on_expiry=s.get("on_expiry", "close"),
            env=s.get("env", {}),
            labels=rec.labels,
            created_at=rec.created_at,
            expires_at=rec.expires_at,
            error=rec.error,
            workdir=rec.workdir,
            display_size=s.get("display_size"),
            suspended=rec.suspended if rec.state == "suspended" else None,  # type: ignore[arg-type]
            cpu_class=s.get("cpu_class", "interactive"),
            **self._net_info(rec.id),
        )

    def _net_info(self, sandbox_id: str) -> dict[str, Any]:
        row = self.store.net_get(sandbox_id)
        if row is None:
            return {}
        return {
            "network": NetworkPolicy.model_validate_json(row[1]),
            "address": self.network.addresses(row[0])[1],
        }

    def list(self, wanted: dict[str, str] | None = None) -> builtins.list[SandboxInfo]:
        records = self.store.list(ACTIVE_STATES, wanted)
        if not wanted or labels.POOL not in wanted:
            # Pooled function-call workers are the platform's, not the caller's.
            records = [r for r in records if labels.POOL not in r.labels]
        return [self.info(r) for r in records]
