"""Burst targets: other Corral clusters a gateway spills creates to when
its own nodes are nearly full (docs/bursting.md).

A target is another gateway, reached over HTTP with a project key of that
cluster, and a cap on the sandboxes placed there at once. The home gateway
uses it when local utilisation (the larger of slots and memory promised,
over the alive nodes) reaches the threshold, or when no local node can
take the sandbox. A burst sandbox has a row at home like any other:
charged to the caller's project at home (the target charges its own
project, the burst account, by its own rules), named `<target>-<token>`
(its id there is `<node>-<token>`, kept in the row), so every later call
routes through the home gateway to the target. The cap is checked after
the row is written, so concurrent creates and gateway replicas never
exceed it together.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

from pydantic import BaseModel

from corral import ids
from corral.api.http import HttpService
from corral.api.service import SandboxService
from corral.control import nodes
from corral.control.nodes import NodeRow
from corral.errors import InvalidArgument

DEFAULT_THRESHOLD = 0.8
MAX_CAP = 1_000_000


@dataclass(frozen=True)
class BurstTarget:
    name: str  # the id prefix of the sandboxes placed there
    url: str  # the other cluster's gateway
    api_key: str  # a project key of the other cluster
    cap: int = 100

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def parse_targets(docs: object, node_names: Sequence[str] = ()) -> list[BurstTarget]:
    """Targets from their JSON (a list of {name, url, api_key, cap});
    InvalidArgument naming `burst[i].field` for the first bad one."""
    if not isinstance(docs, list):
        raise InvalidArgument("burst", "must be a list of targets", type(docs).__name__)
    out: list[BurstTarget] = []
    for i, doc in enumerate(docs):
        where = f"burst[{i}]"
        if not isinstance(doc, dict):
            raise InvalidArgument(where, "must be an object {name, url, api_key, cap}", doc)
        unknown = set(doc) - {"name", "url", "api_key", "cap"}
        if unknown:
            raise InvalidArgument(f"{where}.{sorted(unknown)[0]}", "is not a target field", doc)
        name, url, key = doc.get("name"), doc.get("url"), doc.get("api_key")
        cap = doc.get("cap", 100)
        ids.check_node(name, f"{where}.name")  # type: ignore[arg-type]
        if name in node_names or any(t.name == name for t in out):
            raise InvalidArgument(f"{where}.name", "must differ from every node and target", name)
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise InvalidArgument(f"{where}.url", "must be an http(s):// gateway URL", url)
        if not isinstance(key, str) or not key.strip():
            raise InvalidArgument(f"{where}.api_key", "must be a project key of that cluster", "")
        if not isinstance(cap, int) or isinstance(cap, bool) or not 1 <= cap <= MAX_CAP:
            raise InvalidArgument(f"{where}.cap", f"must be an integer from 1 to {MAX_CAP}", cap)
        out.append(BurstTarget(name, url.rstrip("/"), key.strip(), cap))  # type: ignore[arg-type]
    return out


def load_targets(path: Path) -> list[BurstTarget]:
    try:
        docs = json.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidArgument("burst_targets", "must be a readable JSON file", str(path)) from None
    except ValueError as exc:
        raise InvalidArgument("burst_targets", f"must be JSON ({exc})", str(path)) from None
    return parse_targets(docs)


def check_threshold(value: float) -> float:
    if not 0.0 < value <= 1.0:
        raise InvalidArgument("burst_threshold", "must be a share in (0, 1]", value)
    return value


def utilisation(fleet: Sequence[NodeRow], in_flight: dict[str, int]) -> float:
    """The larger of slots and memory promised, as a share of the alive
    nodes' totals (creates in flight count as taken); 1.0 with no node."""
    alive = [n for n in fleet if n.state == nodes.ALIVE]
    slots = sum(n.capacity.max_sandboxes for n in alive)
    memory = sum(n.capacity.memory_budget for n in alive)
    if not slots or not memory:
        return 1.0
    used = sum(n.capacity.active + in_flight.get(n.name, 0) for n in alive)
    promised = sum(n.capacity.memory_promised for n in alive)
    return max(used / slots, promised / memory)


def home_id(target: str, remote_id: str) -> str:
    """The id a burst sandbox has at home: the target's name, the same token."""
    return f"{target}-{ids.parse(remote_id, 'id').token}"


class Targets:
    """The targets of one gateway, with a connection pool each."""

    def __init__(self, targets: Sequence[BurstTarget], threshold: float) -> None:
        self.threshold = check_threshold(threshold)
        self.by_name = {t.name: t for t in targets}
        self._clients: dict[str, HttpService] = {}

    def __bool__(self) -> bool:
        return bool(self.by_name)

    def client(self, name: str) -> HttpService:
        if name not in self._clients:
            t = self.by_name[name]
            self._clients[name] = HttpService(t.url, api_key=t.api_key)
        return self._clients[name]

    async def aclose(self) -> None:
        for c in self._clients.values():
            await c.aclose()
        self._clients.clear()


def _swap(value: Any, old: str, new: str) -> Any:
    """`value` with every string equal to `old` replaced by `new` (models,
    lists and dicts looked into)."""
    if isinstance(value, str):
        return new if value == old else value
    if isinstance(value, BaseModel):
        doc = value.model_dump(mode="json")
        swapped = _swap(doc, old, new)
        return value if swapped == doc else type(value).model_validate(swapped)
    if isinstance(value, list):
        return [_swap(v, old, new) for v in value]
    if isinstance(value, dict):
        return {k: _swap(v, old, new) for k, v in value.items()}
    return value


class Aliased:
    """A target's service as seen for one sandbox: its home id in the
    arguments becomes its id there, and back in the answers."""

    def __init__(self, service: HttpService, home: str, remote: str) -> None:
        self._service, self._home, self._remote = service, home, remote

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._service, name)

        def call(*args: Any, **kw: Any) -> Any:
            args = tuple(_swap(a, self._home, self._remote) for a in args)
            kw = {k: _swap(v, self._home, self._remote) for k, v in kw.items()}
            result = method(*args, **kw)
            if hasattr(result, "__aiter__"):
                return self._stream(result)
            return self._answer(result)

        return call

    async def _answer(self, pending: Any) -> Any:
        return _swap(await pending, self._remote, self._home)

    async def _stream(self, items: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for item in items:
            yield _swap(item, self._remote, self._home)

    def as_service(self) -> SandboxService:
        return cast(SandboxService, self)


def remote_labels(labels: dict[str, str], reserved: builtins.set[str]) -> dict[str, str]:
    """The caller's labels without the home platform's (the target sets its own)."""
    return {k: v for k, v in labels.items() if k not in reserved}


class BurstRefused(Exception):
    """No target took the create: why, per target."""

    def __init__(self, reasons: builtins.list[str]) -> None:
        super().__init__("; ".join(reasons))
        self.reasons = reasons
