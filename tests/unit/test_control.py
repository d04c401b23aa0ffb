"""The control plane's state on SQLite: migrations, nested quotas, the
sandbox row's state machine, membership and lost nodes. The same SQL runs
on PostgreSQL in tests/integration/test_cluster.py."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from corral import metrics
from corral.capacity import NodeCapacity
from corral.control import nodes, placement, quotas, sandboxes, schema
from corral.control.nodes import NodeRow
from corral.db import Database, connect
from corral.errors import (
    Conflict,
    InvalidArgument,
    NodeFull,
    NotFound,
    ResourceExhausted,
    SandboxLost,
    SandboxNotFound,
    Unavailable,
)

GiB = 2**30


@pytest.fixture
async def db(tmp_path: Path) -> AsyncIterator[Database]:
    d = await connect(f"sqlite:///{tmp_path}/state.db")
    await schema.migrate(d)
    yield d
    await d.aclose()


# ------------------------------------------------------------------ schema


async def test_migrations_run_once_and_a_newer_schema_is_refused(tmp_path: Path) -> None:
    d = await connect(f"sqlite:///{tmp_path}/s.db")
    assert await schema.migrate(d) == 0
    assert await schema.migrate(d) == schema.VERSION  # nothing to do the second time
    async with d.transaction() as tx:
        await tx.execute("UPDATE corral_schema SET version = %s", (schema.VERSION + 1,))
    with pytest.raises(Unavailable, match="newer than this Corral"):
        await schema.migrate(d)
    await d.aclose()


@pytest.mark.parametrize(
    "url", ["", "mysql://x", "sqlite://relative.db", "postgresql", "file:///x.db"]
)
async def test_a_bad_state_url_names_the_field(url: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        await connect(url)
    assert err.value.field == "state" and err.value.value == url


async def test_a_failed_transaction_changes_nothing(db: Database) -> None:
    await quotas.create_project(db, "org")
    with pytest.raises(RuntimeError):
        async with db.transaction() as tx:
            await tx.execute("UPDATE projects SET max_sandboxes = 1 WHERE name = 'org'")
            raise RuntimeError("boom")
    assert (await quotas.get_project(db, "org")).max_sandboxes is None


# ------------------------------------------------------------------ quotas


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"name": ""}, "name"),
        ({"name": "Org"}, "name"),
        ({"name": "-org"}, "name"),
        ({"name": "a" * 64}, "name"),
        ({"name": "a/b"}, "name"),
        ({"name": "ok", "max_sandboxes": -1}, "max_sandboxes"),
        ({"name": "ok", "max_cpu": -0.5}, "max_cpu"),
        ({"name": "ok", "max_memory": -1}, "max_memory"),
    ],
)
async def test_bad_projects_are_refused_and_nothing_is_made(
    db: Database, kw: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidArgument) as err:
        await quotas.create_project(db, **kw)
    assert err.value.field == field
    assert await quotas.list_projects(db) == []


async def test_project_parents_exist_names_are_unique_and_nesting_is_bounded(
    db: Database,
) -> None:
    with pytest.raises(NotFound, match="no project 'ghost'"):
        await quotas.create_project(db, "job", parent="ghost")
    await quotas.create_project(db, "l0")
    with pytest.raises(Conflict):
        await quotas.create_project(db, "l0")
    for i in range(1, quotas.MAX_DEPTH):
        await quotas.create_project(db, f"l{i}", parent=f"l{i - 1}")
    with pytest.raises(InvalidArgument, match="at most 8 levels"):
        await quotas.create_project(db, "deep", parent=f"l{quotas.MAX_DEPTH - 1}")
    assert len(await quotas.list_projects(db)) == quotas.MAX_DEPTH


async def _tree(db: Database) -> None:
    await quotas.create_project(db, "org", max_sandboxes=3, max_memory=10 * GiB)
    await quotas.create_project(db, "team", parent="org", max_cpu=4)
    await quotas.create_project(db, "job", parent="team", max_sandboxes=100)


async def test_a_charge_goes_up_the_chain_and_release_gives_it_back(db: Database) -> None:
    await _tree(db)
    async with db.transaction() as tx:
        await quotas.charge(tx, "job", 1.5, GiB)
    for name in ("job", "team", "org"):
        p = await quotas.get_project(db, name)
        assert (p.used_sandboxes, p.used_cpu, p.used_memory) == (1, 1.5, GiB)
    async with db.transaction() as tx:
        await quotas.release(tx, "job", 1.5, GiB)
    for name in ("job", "team", "org"):
        p = await quotas.get_project(db, name)
        assert (p.used_sandboxes, p.used_cpu, p.used_memory) == (0, 0.0, 0)


@pytest.mark.parametrize(
    ("charges", "level", "resource"),
    [
        ([(1, GiB)] * 4, "org", "sandboxes"),  # the job allows 100, the org 3
        ([(3, GiB), (2, GiB)], "team", "cpu"),
        ([(1, 6 * GiB), (1, 5 * GiB)], "org", "memory"),
    ],
)
async def test_the_level_that_is_full_refuses_and_names_itself(
    db: Database, charges: list[tuple[float, int]], level: str, resource: str
) -> None:
    await _tree(db)
    *fits, last = charges
    for cpu, memory in fits:
        async with db.transaction() as tx:
            await quotas.charge(tx, "job", cpu, memory)
    before = {p.name: p for p in await quotas.list_projects(db)}
    with pytest.raises(ResourceExhausted) as err:
        async with db.transaction() as tx:
            await quotas.charge(tx, "job", *last)
    d = err.value.details
    assert (d["project"], d["resource"], d["quota"]) == (level, resource, True)
    assert f"project {level!r}" in err.value.message and "ancestor of 'job'" in err.value.message
    # Refused means not charged anywhere, not even at the levels that had room.
    assert {p.name: p for p in await quotas.list_projects(db)} == before


# ------------------------------------------------------------------ sandbox rows


async def test_a_reserved_key_is_found_again_not_charged_twice(db: Database) -> None:
    await _tree(db)
    key = sandboxes.node_key("job", "item-0")
    assert key != sandboxes.node_key("team", "item-0")  # projects never share keys
    row, new = await sandboxes.reserve(db, key, "job", "n0", "container", 1, GiB)
    again, new2 = await sandboxes.reserve(db, key, "job", "n1", "container", 1, GiB)
    assert (new, new2) == (True, False) and again.node == "n0"
    assert (await quotas.get_project(db, "org")).used_sandboxes == 1
    assert row.state == "placing"


async def test_rows_move_only_from_where_they_are(db: Database) -> None:
    await _tree(db)
    key = sandboxes.node_key("job", "k")
    await sandboxes.reserve(db, key, "job", "n0", "container", 1, GiB)
    assert await sandboxes.move(db, key, "n0", "n1") is True
    assert await sandboxes.move(db, key, "n0", "n2") is False  # a second re-driver loses
    ready = await sandboxes.mark_ready(db, key, "n1-0123456789abcdef")
    assert ready is not None and ready.state == "ready" and ready.node == "n1"
    assert await sandboxes.move(db, key, "n1", "n2") is False  # ready rows stay put
    found = await sandboxes.by_id(db, "n1-0123456789abcdef")
    assert found is not None and found.key == key


async def test_the_quota_is_released_exactly_once(db: Database) -> None:
    await _tree(db)
    key = sandboxes.node_key("job", "k")
    await sandboxes.reserve(db, key, "job", "n0", "container", 1, GiB)
    await sandboxes.mark_ready(db, key, "n0-0123456789abcdef")
    assert await sandboxes.finish(db, key, "closed") is True
    assert await sandboxes.finish(db, key, "closed") is False
    assert await sandboxes.finish(db, key, "failed", "late") is False
    assert (await quotas.get_project(db, "org")).used_sandboxes == 0


async def test_a_failed_row_is_charged_and_placed_again(db: Database) -> None:
    await _tree(db)
    key = sandboxes.node_key("job", "k")
    await sandboxes.reserve(db, key, "job", "n0", "container", 1, GiB)
    await sandboxes.finish(db, key, "failed", "image missing")
    assert (await quotas.get_project(db, "org")).used_sandboxes == 0
    row, new = await sandboxes.reserve(db, key, "job", "n1", "container", 1, GiB)
    assert new and row.state == "placing" and row.node == "n1" and row.error is None
    assert (await quotas.get_project(db, "org")).used_sandboxes == 1


# ------------------------------------------------------------------ membership


async def _age(db: Database, node: str, seconds: float) -> None:
    async with db.transaction() as tx:
        await tx.execute(
            "UPDATE nodes SET heartbeat_at = heartbeat_at - %s WHERE name = %s", (seconds, node)
        )


async def test_a_silent_node_is_lost_with_its_sandboxes_and_their_quota(db: Database) -> None:
    await _tree(db)
    cap = NodeCapacity(max_sandboxes=10, kinds=("container",))
    assert await nodes.heartbeat(db, "n0", "http://a", cap) is None
    assert await nodes.heartbeat(db, "n1", "http://b", cap) is None
    keys = [sandboxes.node_key("job", str(i)) for i in range(3)]
    for i, key in enumerate(keys):
        await sandboxes.reserve(db, key, "job", "n0" if i < 2 else "n1", "container", 1, GiB)
    await sandboxes.mark_ready(db, keys[0], "n0-0000000000000000")
    await _age(db, "n0", 30)
    assert await nodes.sweep_lost(db, timeout=10) == ["n0"]
    assert await nodes.sweep_lost(db, timeout=10) == []  # a second sweeper finds nothing
    states = {k: r.state for k, r in (await sandboxes.by_keys(db, keys)).items()}
    assert states == {keys[0]: "lost", keys[1]: "failed", keys[2]: "placing"}
    assert (await quotas.get_project(db, "org")).used_sandboxes == 1
    # Written off is final: a create that finishes late cannot resurrect it.
    assert await sandboxes.mark_ready(db, keys[1], "n0-1111111111111111") is None
    # The node comes back: alive again, and it says what it was.
    assert await nodes.heartbeat(db, "n0", "http://a", cap) == "lost"
    assert {n.name: n.state for n in await nodes.list_nodes(db)} == {
        "n0": "alive",
        "n1": "alive",
    }
    # Closing a lost sandbox acknowledges it; its quota was released already.
    assert await sandboxes.finish(db, keys[0], "closed") is False
    assert (await sandboxes.by_keys(db, [keys[0]]))[keys[0]].state == "closed"
    assert (await quotas.get_project(db, "org")).used_sandboxes == 1


# ------------------------------------------------------------------ placement


def _node(name: str, **cap: Any) -> NodeRow:
    base: dict[str, Any] = {
        "max_sandboxes": 10,
        "active": 0,
        "memory_budget": 100 * GiB,
        "memory_promised": 0,
        "kinds": ["container", "fncall"],
        "images": [],
    }
    state = cap.pop("state", "alive")
    return NodeRow(name, f"http://{name}", state, 0.5, NodeCapacity.from_wire({**base, **cap}))


def test_placement_filters_and_says_why_nothing_fits() -> None:
    fleet = [
        _node("a", state="lost"),
        _node("b", active=10),
        _node("c", kinds=["fncall"]),
        _node("d", memory_promised=100 * GiB),
        _node("f", cpu_budget=8.0, cpu_promised=7.5),
        _node("g", overloaded="io pressure (full avg10) is 70.00%"),
        _node("e"),
    ]
    with pytest.raises(ResourceExhausted) as err:
        placement.choose(fleet, kind="container", memory=GiB, cpu=1.0, exclude={"e"})
    msg = err.value.message
    for reason in ("1 lost", "1 full", "1 no container backend", "1 not enough memory",
                   "1 not enough CPU", "1 overloaded"):  # fmt: skip
        assert reason in msg
    assert "1 already refused" in msg
    assert placement.choose(fleet, kind="container", memory=GiB, cpu=1.0).name == "e"


BASE, TOP, NEXT = ("sha256:" + c * 64 for c in "abc")


def test_placement_prefers_nodes_with_the_image_by_digest_and_counts_in_flight() -> None:
    rng = random.Random(1)
    image = {"layers": {BASE: ["", 100], TOP: [BASE, 10]}}
    fleet = [
        _node("a"),
        _node("b", tags={"img:1": TOP}, **image),
        _node("c"),
        # The same content under another tag holds the image as well as b.
        _node("d", tags={"mirror/img:one": TOP}, **image),
        # Only the base of the stack: second best.
        _node("e", layers={BASE: ["", 100]}),
    ]
    want = placement.Inventory(fleet).wanted(["img:1"])
    assert want == {TOP: 10, BASE: 100}

    def picks(**kw: Any) -> set[str]:
        return {
            placement.choose(fleet, kind="container", want=want, memory=GiB, rng=rng, **kw).name
            for _ in range(50)
        }

    assert picks() == {"b", "d"}
    # b and d have 10 free slots by heartbeat, but this gateway sent them 10.
    assert picks(in_flight={"b": 10, "d": 10}) == {"e"}
    assert picks(in_flight={"b": 10, "d": 10, "e": 10}) == {"a", "c"}
    # A new version over the same base: the nodes holding the base win.
    fleet.append(_node("f", tags={"img:2": NEXT}, layers={BASE: ["", 100], NEXT: [BASE, 5]}))
    want = placement.Inventory(fleet).wanted(["img:2"])
    assert picks(in_flight={"f": 10}) == {"b", "d", "e"}
    # A reference no node knows prefers nothing.
    assert placement.Inventory(fleet).wanted(["nowhere:1", "sha256:" + "f" * 64]) == {}


def test_power_of_two_choices_spreads_the_load() -> None:
    rng = random.Random(7)
    slots = {"a": 0, "b": 0, "c": 0}
    for _ in range(300):
        fleet = [_node(n, max_sandboxes=200, active=used) for n, used in slots.items()]
        slots[placement.choose(fleet, kind="container", memory=0, rng=rng).name] += 1
    # Each node ends within a few of a third: drawing two and taking the
    # emptier keeps the spread tight even with random draws.
    assert max(slots.values()) - min(slots.values()) <= 3, slots


# ------------------------------------------------------------------ gateway


class NodeTransport:
    """A node agent's HTTP endpoint as the gateway sees it: a transport seam
    (no sandboxes run here); tests/integration/test_cluster.py runs the
    same gateway against real node agents."""

    def __init__(self, name: str, full: bool) -> None:
        self.name = name
        self.full = full
        self.made: dict[str, Any] = {}  # by idempotency key
        self.calls: list[tuple[Any, ...]] = []
        self.refuse: Exception | None = None  # what the next create, fork or restore raises
        self.meanwhile: Any = None  # awaited before a create answers

    def _make(self, key: str, kind: str = "container", labels: dict[str, str] | None = None) -> Any:
        from corral.api.models import SandboxInfo, SandboxState

        if self.refuse is not None:
            raise self.refuse
        if key in self.made:
            return self.made[key]
        info = SandboxInfo(
            id=f"{self.name}-{len(self.made):016x}",
            node=self.name,
            kind=kind,
            state=SandboxState.running,
            image="img:1",
            workspace=None,
            toolkit=[],
            layers=[],
            cpu=1.0,
            memory=GiB,
            disk=GiB,
            pids=64,
            ttl=None,
            idle_timeout=None,
            env={},
            labels=labels or {},
            created_at=0.0,
            expires_at=None,
        )
        self.made[key] = info
        return info

    async def create(self, req: Any) -> Any:
        if self.full:
            raise NodeFull(f"node {self.name} is full", node=self.name, reason="slots")
        self.calls.append(("create", req.idempotency_key))
        if self.meanwhile is not None:
            await self.meanwhile(req)
        return self._make(req.idempotency_key, req.kind, req.labels)

    async def restore(self, req: Any) -> Any:
        self.calls.append(("restore", req.idempotency_key))
        return self._make(req.idempotency_key, req.kind)

    async def fork(self, sandbox_id: str, req: Any) -> Any:
        self.calls.append(("fork", sandbox_id, req.idempotency_keys))
        return [self._make(key) for key in req.idempotency_keys]

    async def get(self, sandbox_id: str) -> Any:
        for info in self.made.values():
            if info.id == sandbox_id:
                return info
        raise SandboxNotFound(f"no sandbox {sandbox_id}", sandbox=sandbox_id)

    async def read_file(
        self, sandbox_id: str, path: str, user: str = "", follow_symlinks: bool = True
    ) -> bytes:
        self.calls.append(("read_file", sandbox_id, path, user))
        return b"data"

    async def close(self, sandbox_id: str) -> None:
        self.calls.append(("close", sandbox_id))

    async def run_call(self, req: Any) -> Any:
        from corral.api.models import FnCallResult

        if self.full:
            raise NodeFull(f"node {self.name} has no free worker", node=self.name, reason="slots")
        return FnCallResult(
            status="ok", exit_code=0, stdout=self.name, stderr="", wall_time=0, cpu_time=0,
            peak_memory=0,
        )  # fmt: skip

    async def aclose(self) -> None:
        pass


async def _gateway(db: Database, full: dict[str, bool]) -> tuple[Any, dict[str, NodeTransport]]:
    from corral.control.gateway import Gateway

    gw = await Gateway(db, node_key="nk").start(sweep=False)
    transports = {}
    for name, is_full in full.items():
        # The nodes that will take a sandbox look busier, so placement always
        # asks a full one first (else random ties could skip the refusal).
        cap = NodeCapacity(
            max_sandboxes=10,
            active=0 if is_full else 5,
            memory_budget=100 * GiB,
            kinds=("container", "fncall", "microvm"),
        )
        await nodes.heartbeat(db, name, f"http://{name}", cap)
        transports[name] = NodeTransport(name, is_full)
        gw._clients[(name, f"http://{name}")] = transports[name]
    return gw, transports


async def test_a_node_that_answers_full_sends_the_create_elsewhere(db: Database) -> None:
    from corral.api.models import CreateSandbox
    from corral.control.view import GatewayView

    await quotas.create_project(db, "p", max_sandboxes=5)
    gw, transports = await _gateway(db, {"a": True, "b": True, "c": False})
    view = GatewayView(gw, "p")
    for i in range(4):
        req = CreateSandbox(image="img:1", idempotency_key=f"k{i}")
        info = await view.create(req)
        assert info.node == "c"  # whichever it tried first, only c said yes
        again = await view.create(req)  # the same key: found, not made again
        assert again.id == info.id
    assert len(transports["c"].made) == 4
    text = metrics.exposition().decode()
    assert 'corral_gateway_create_elsewhere_total{reason="full"}' in text
    assert 'corral_gateway_creates_total{outcome="found"}' in text
    assert (await quotas.get_project(db, "p")).used_sandboxes == 4
    async with db.transaction() as tx:
        rows = await tx.fetchall("SELECT node, state FROM sandboxes")
    assert rows == [("c", "ready")] * 4
    assert gw.in_flight == {}  # every hold was released
    await gw.aclose()


async def test_when_every_node_is_full_the_create_fails_and_gives_back_its_quota(
    db: Database,
) -> None:
    from corral.api.models import CreateSandbox
    from corral.control.view import GatewayView

    await quotas.create_project(db, "p")
    gw, _ = await _gateway(db, {"a": True, "b": True})
    with pytest.raises(ResourceExhausted, match="2 already refused this create"):
        await GatewayView(gw, "p").create(CreateSandbox(image="img:1"))
    assert (await quotas.get_project(db, "p")).used_sandboxes == 0
    async with db.transaction() as tx:
        assert await tx.fetchall("SELECT state FROM sandboxes") == [("failed",)]
    assert gw.in_flight == {}
    await gw.aclose()


async def test_a_forwarded_call_reaches_the_node_its_sandbox_id_names(db: Database) -> None:
    from corral.api.models import CreateSandbox
    from corral.control.view import GatewayView

    await quotas.create_project(db, "p")
    gw, transports = await _gateway(db, {"a": False, "b": False})
    view = GatewayView(gw, "p")
    info = await view.create(CreateSandbox(image="img:1"))
    node = transports[info.node]
    assert await view.read_file(info.id, "/etc/x", "nobody") == b"data"
    assert node.calls[-1] == ("read_file", info.id, "/etc/x", "nobody")
    # The node lost it (TTL): the caller hears so, and the row is closed.
    node.made.clear()
    with pytest.raises(SandboxNotFound):
        await view.get(info.id)
    assert (await sandboxes.by_id(db, info.id)).state == "closed"  # type: ignore[union-attr]
    assert (await quotas.get_project(db, "p")).used_sandboxes == 0
    await gw.aclose()


async def test_ids_are_parsed_once_and_a_stranger_node_is_named(db: Database) -> None:
    from corral.control.view import GatewayView

    gw, _ = await _gateway(db, {"a": False})
    view = GatewayView(gw, "p")
    with pytest.raises(InvalidArgument) as bad:
        await view.get("a-xyz")
    assert (bad.value.field, bad.value.rule) == ("sandbox_id", "must be <node>-<16 hex digits>")
    with pytest.raises(SandboxNotFound, match="node 'zz' is not a member of this cluster"):
        await view.get("zz-0123456789abcdef")
    with pytest.raises(SandboxNotFound) as unknown:
        await view.get("a-0123456789abcdef")
    assert "not a member" not in unknown.value.message
    await gw.aclose()


async def test_a_quota_refusal_from_a_node_is_not_taken_elsewhere(db: Database) -> None:
    from corral.api.models import CreateSandbox
    from corral.control.view import GatewayView

    await quotas.create_project(db, "p")
    gw, transports = await _gateway(db, {"a": False, "b": False})
    for t in transports.values():
        t.refuse = ResourceExhausted("the node's scratch space is full")
    with pytest.raises(ResourceExhausted, match="scratch"):
        await GatewayView(gw, "p").create(CreateSandbox(image="img:1"))
    assert sum(len(t.calls) for t in transports.values()) == 1  # one node asked, once
    async with db.transaction() as tx:
        assert await tx.fetchall("SELECT state FROM sandboxes") == [("failed",)]
    assert (await quotas.get_project(db, "p")).used_sandboxes == 0
    assert gw.in_flight == {}
    await gw.aclose()


async def test_a_sandbox_written_off_while_it_is_made_is_closed_and_reported_lost(
    db: Database,
) -> None:
    from corral.api.models import CreateSandbox
    from corral.control.view import GatewayView

    await quotas.create_project(db, "p")
    gw, transports = await _gateway(db, {"a": False})

    async def node_lost_meanwhile(req: Any) -> None:
        await sandboxes.finish(db, req.idempotency_key, "failed", "node a was lost")

    transports["a"].meanwhile = node_lost_meanwhile
    with pytest.raises(
        SandboxLost, match=r"written off .* its record is failed \(node a was lost\)"
    ):
        await GatewayView(gw, "p").create(CreateSandbox(image="img:1"))
    assert transports["a"].calls[-1] == ("close", "a-0000000000000000")
    await gw.aclose()


async def test_a_fork_charges_a_row_per_copy_and_a_failed_one_gives_them_back(
    db: Database,
) -> None:
    from corral.api.models import CreateSandbox, ForkRequest
    from corral.control.view import GatewayView

    await quotas.create_project(db, "p", max_sandboxes=3)
    gw, transports = await _gateway(db, {"a": False})
    view = GatewayView(gw, "p")
    source = await view.create(CreateSandbox(kind="microvm", image="img:1"))
    node = transports["a"]
    node.refuse = Unavailable("the VM did not answer")
    with pytest.raises(Unavailable):
        await view.fork(source.id, ForkRequest(n=2, idempotency_keys=["x", "y"]))
    assert (await quotas.get_project(db, "p")).used_sandboxes == 1
    with pytest.raises(ResourceExhausted):  # 1 + 3 is past the quota: none is charged
        await view.fork(source.id, ForkRequest(n=3))
    assert (await quotas.get_project(db, "p")).used_sandboxes == 1
    node.refuse = None
    copies = await view.fork(source.id, ForkRequest(n=2, idempotency_keys=["x", "y"]))
    assert [c.node for c in copies] == ["a", "a"]
    assert (await quotas.get_project(db, "p")).used_sandboxes == 3
    again = await view.fork(source.id, ForkRequest(n=2, idempotency_keys=["x", "y"]))
    assert [c.id for c in again] == [c.id for c in copies]  # found, not made again
    assert [c[0] for c in node.calls].count("fork") == 2
    await gw.aclose()


async def test_a_restore_is_placed_and_charged_like_a_create(db: Database) -> None:
    from corral.api.models import SavedState
    from corral.control.view import GatewayView

    key = "vmstates/a-0123456789abcdef"
    await quotas.create_project(db, "p")
    gw, transports = await _gateway(db, {"a": False})
    view = GatewayView(gw, "p")
    saved = SavedState(
        key=key, kind="microvm", idempotency_key="r1", cpu=1, memory=GiB, project="p"
    )
    # Another project's state, or one without its saved size, is refused
    # before any node is asked or anything charged (no store is opened).
    for bad in ({"project": "q"}, {"project": None}, {"memory": 0}):
        with pytest.raises(InvalidArgument):
            await view.restore(saved.model_copy(update=bad))
    assert transports["a"].calls == []
    transports["a"].refuse = InvalidArgument("key", "names no state", key)
    with pytest.raises(InvalidArgument):
        await view.restore(saved)
    assert (await quotas.get_project(db, "p")).used_sandboxes == 0
    transports["a"].refuse = None
    info = await view.restore(saved)
    assert (await sandboxes.by_id(db, info.id)).state == "ready"  # type: ignore[union-attr]
    assert (await view.restore(saved)).id == info.id  # found: the node is not asked again
    assert [c[0] for c in transports["a"].calls] == ["restore", "restore"]
    assert (await quotas.get_project(db, "p")).used_sandboxes == 1
    await gw.aclose()


async def test_a_function_call_skips_nodes_that_are_full(db: Database) -> None:
    from corral.api.models import FnCallRequest
    from corral.control.view import GatewayView

    gw, _ = await _gateway(db, {"a": True, "b": True, "c": False})
    result = await GatewayView(gw, "p").run_call(FnCallRequest(language="python", code="1"))
    assert result.stdout == "c"
    assert gw.in_flight == {}
    await gw.aclose()


async def test_a_node_that_joined_after_the_snapshot_is_placed_on_at_once(db: Database) -> None:
    """The membership snapshot is cached; a create that finds no node in it
    looks once more at the membership as it is now (a preempted job's
    sandboxes restored right after their new host joined)."""
    from corral.control.gateway import Gateway

    gw = await Gateway(db, node_key="nk").start(sweep=False)
    assert await gw.nodes() == []  # the snapshot: nobody
    cap = NodeCapacity(max_sandboxes=10, memory_budget=100 * GiB, kinds=("container",))
    await nodes.heartbeat(db, "late", "http://late", cap)
    node = await gw.choose(kind="container", layers=(), memory=GiB, exclude=set())
    assert node.name == "late" and gw.in_flight == {"late": 1}
    gw.release("late")
    await gw.aclose()


async def test_a_layer_committed_through_the_gateway_is_placed_on_before_its_heartbeat(
    db: Database,
) -> None:
    """A create from a commit made a moment ago: its node's heartbeat has
    not reported the layer yet, and no other node can fetch a project's
    commit. Before, such a create landed on any node (half the time the
    wrong one, on two), and failed there as 'not found'."""
    from corral.api.models import LayerInfo
    from corral.control.gateway import Gateway

    gw = await Gateway(db, node_key="nk").start(sweep=False)
    cap = NodeCapacity(max_sandboxes=10, memory_budget=100 * GiB, kinds=("container",))
    for name in ("n0", "n1", "n2"):
        await nodes.heartbeat(db, name, f"http://{name}", cap)
    await gw.nodes(fresh=True)
    layer = LayerInfo(
        digest="sha256:" + "a" * 64, names=["projects/p/x:1"], kind="toolkit",
        parent="sha256:" + "b" * 64, content_size=5, meta_size=10, blob_size=20,
        chunk_size=4096, created=0.0,
    )  # fmt: skip
    gw.note_layer("n1", layer)
    for ref in ("projects/p/x:1", layer.digest):
        assert gw.inventory.wanted([ref]) == {layer.digest: 30}
    await gw.nodes(fresh=True)  # read again, before n1's heartbeat has it
    for _ in range(10):
        node = await gw.choose(kind="container", layers=[layer.digest], memory=GiB, exclude=set())
        assert node.name == "n1"
        gw.release("n1")
    await gw.aclose()
