"""The cluster's small parts, alone: direct tokens, burst routing helpers,
`cluster up`'s preflight and journal, and image-source settings."""

from __future__ import annotations

import socket
import stat
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from corral import labels
from corral.api import direct
from corral.capacity import NodeCapacity
from corral.cluster import journal, preflight
from corral.config import NodeConfig
from corral.control import burst
from corral.control.nodes import NodeRow
from corral.errors import InvalidArgument, Unauthenticated

SECRET = "nk-test"
SID = "n0-" + "a" * 16


# ------------------------------------------------------------------ direct tokens


def test_a_direct_token_is_good_for_its_sandbox_and_node_until_it_expires() -> None:
    token, expires = direct.issue(SECRET, SID, "n0", 60)
    assert direct.is_token(token) and expires > time.time()
    assert direct.verify(SECRET, token, "n0") == SID


@pytest.mark.parametrize(
    ("mangle", "says"),
    [
        (lambda t: t[:-3] + ("AAA" if not t.endswith("AAA") else "BBB"), "signature"),
        (lambda t: t + ".extra", "dt1.<payload>.<mac>"),
        (lambda t: "dt1.x.y.z", "dt1.<payload>.<mac>"),
        (lambda t: t, "for node n0, not this node (n1)"),
    ],
)
def test_a_forged_or_misdirected_direct_token_is_refused(mangle: Any, says: str) -> None:
    token, _ = direct.issue(SECRET, SID, "n0", 60)
    with pytest.raises(Unauthenticated) as err:
        direct.verify(SECRET, mangle(token), "n1" if "not this node" in says else "n0")
    assert says in err.value.message


def test_an_expired_direct_token_says_so_and_another_key_does_not_verify() -> None:
    token, _ = direct.issue(SECRET, SID, "n0", 1)
    with pytest.raises(Unauthenticated, match="signature"):
        direct.verify("another-key", token, "n0")
    time.sleep(1.05)
    with pytest.raises(Unauthenticated, match="expired"):
        direct.verify(SECRET, token, "n0")


@pytest.mark.parametrize("ttl", [0, -1, 3601, True, 1.5, "60"])
def test_a_direct_ttl_out_of_range_names_the_field(ttl: Any) -> None:
    with pytest.raises(InvalidArgument) as err:
        direct.check_ttl(ttl)
    assert err.value.details["field"] == "ttl"


class _Service:
    async def get(self, sandbox_id: str) -> _Info:
        return _Info(id=sandbox_id, labels={labels.E2B_TOKEN: "envd-secret", "team": "a"})

    async def close(self, sandbox_id: str) -> None:
        raise AssertionError("never reached")


async def test_a_direct_service_allows_its_sandbox_and_the_allowed_operations_only() -> None:
    svc = direct.DirectService(_Service(), SID).as_service()  # type: ignore[arg-type]
    got = await svc.get(SID)
    # A direct token lives an hour; the sandbox's E2B token as long as it:
    # the one never hands out the other.
    assert got.id == SID and got.labels == {labels.E2B_TOKEN: "", "team": "a"}
    with pytest.raises(Unauthenticated, match="for sandbox"):
        await svc.get("n0-" + "b" * 16)
    with pytest.raises(Unauthenticated, match="does not allow close"):
        await svc.close(SID)
    for name in ("create", "list", "fork", "save", "suspend", "set_ttl", "update_network"):
        assert name not in direct.ALLOWED


# ------------------------------------------------------------------ burst


def _node(
    name: str, active: int, slots: int = 10, promised: int = 0, state: str = "alive"
) -> NodeRow:
    cap = NodeCapacity(
        max_sandboxes=slots, active=active, memory_budget=100, memory_promised=promised
    )
    return NodeRow(name, f"http://{name}", state, 0.1, cap)


def test_utilisation_is_the_larger_of_slots_and_memory_over_alive_nodes() -> None:
    fleet = [_node("a", 4), _node("b", 2, promised=90), _node("c", 10, state="lost")]
    assert burst.utilisation(fleet, {}) == pytest.approx(0.45)  # memory 90 of 200 > slots 6 of 20
    assert burst.utilisation(fleet[:1], {"a": 4}) == pytest.approx(0.8)  # in flight counts
    assert burst.utilisation([], {}) == 1.0  # no node: nothing fits here


def test_a_burst_sandbox_keeps_its_token_under_the_target_name() -> None:
    assert burst.home_id("east", "k3-" + "c" * 16) == "east-" + "c" * 16


class _Info(BaseModel):
    id: str
    labels: dict[str, str]


class _Remote:
    def __init__(self) -> None:
        self.seen: list[str] = []

    async def get(self, sandbox_id: str) -> _Info:
        self.seen.append(sandbox_id)
        return _Info(id=sandbox_id, labels={"x": sandbox_id, "y": "kept"})


async def test_aliased_calls_use_the_remote_id_and_answer_with_the_home_id() -> None:
    remote, home, there = _Remote(), "east-" + "d" * 16, "w0-" + "d" * 16
    svc = burst.Aliased(remote, home, there).as_service()  # type: ignore[arg-type]
    info = await svc.get(home)
    assert remote.seen == [there]
    assert info.id == home and info.labels == {"x": home, "y": "kept"}


@pytest.mark.parametrize("threshold", [0, -0.1, 1.01])
def test_a_burst_threshold_outside_0_1_names_the_field(threshold: float) -> None:
    with pytest.raises(InvalidArgument) as err:
        burst.check_threshold(threshold)
    assert err.value.details["field"] == "burst_threshold"


# ------------------------------------------------------------------ cluster up


def test_preflight_refuses_a_busy_port_naming_the_flag_and_holder() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(InvalidArgument) as err:
            preflight.check_ports({"gateway_port": ("127.0.0.1", port, False)})
    assert err.value.details["field"] == "gateway_port"
    assert "in use" in err.value.message and "--gateway-port" in err.value.message


@pytest.mark.parametrize(
    ("ports", "field", "says"),
    [
        ({"pg_port": ("127.0.0.1", 0, False)}, "pg_port", "between 1 and 65535"),
        ({"pg_port": ("127.0.0.1", 70000, False)}, "pg_port", "between 1 and 65535"),
        (
            {"pg_port": ("127.0.0.1", 40001, False), "gateway_port": ("127.0.0.1", 40001, False)},
            "gateway_port",
            "must differ from pg_port",
        ),
    ],
)
def test_preflight_refuses_bad_ports(ports: Any, field: str, says: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        preflight.check_ports(ports)
    assert err.value.details["field"] == field and says in err.value.message


def test_preflight_refuses_a_relative_dir_or_a_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="absolute"):
        preflight.check_dir(Path("rel/dir"), for_postgres=False)
    (tmp_path / "f").write_text("")
    with pytest.raises(InvalidArgument, match="is a file"):
        preflight.check_dir(tmp_path / "f" / "sub", for_postgres=False)


def test_the_journal_is_private_from_its_first_byte(tmp_path: Path) -> None:
    journal.save(tmp_path, {"node_key": "secret", "phase": journal.STARTING})
    mode = stat.S_IMODE((tmp_path / "cluster.json").stat().st_mode)
    assert mode == 0o600
    assert journal.load(tmp_path)["phase"] == "starting"
    journal.remove(tmp_path)
    assert journal.load_or_new(tmp_path) == {}


@pytest.mark.parametrize(
    ("sources", "field"),
    [
        ("/a", "image_sources"),
        (["relative"], "image_sources[0]"),
        (["/ok", "ftp://x"], "image_sources[1]"),
        ([7], "image_sources[0]"),
    ],
)
def test_bad_image_sources_name_the_entry(sources: Any, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        NodeConfig(image_sources=sources)
    assert err.value.details["field"] == field


# ------------------------------------------------------------------ cluster down


async def test_teardown_goes_past_nodes_that_do_not_answer_as_nodes() -> None:
    """A node whose port is closed, or held by another program's HTTP
    server (404 for everything), is reported and skipped: the rest of the
    teardown (Ray, PostgreSQL, the data dirs) must still run."""
    import asyncio

    from corral.cluster.down import _close_all

    async def not_found(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        w.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 14\r\n\r\n404: Not Found")
        await w.drain()
        w.close()

    server = await asyncio.start_server(not_found, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    said: list[str] = []
    doc = {
        "node_key": SECRET,
        "nodes": {"n0": f"http://127.0.0.1:{port}", "n1": f"http://127.0.0.1:{closed}"},
    }
    async with server:
        await _close_all(doc, said.append)
    assert [m.split(":")[0] for m in said] == ["node n0", "node n1"], said
    assert all("data dir is cleaned below" in m for m in said), said
    assert "404" in said[0], said


def test_the_cluster_denies_its_own_hosts_to_every_sandbox() -> None:
    """Ray's ports take no key: a sandbox whose policy names a private range
    must still never reach a node, Ray's head, the state store or the
    gateway. cluster up gives every node their addresses as network_deny."""
    from corral.cluster.actors import NodeSpec
    from corral.cluster.up import control_plane

    deny = control_plane(
        ["192.0.2.10", "192.0.2.11", "2001:db8::11"], "192.0.2.10:6379",
        "postgresql://corral@198.51.100.5:5432/c", "0.0.0.0",
    )  # fmt: skip
    assert deny == ["192.0.2.10/32", "192.0.2.11/32", "198.51.100.5/32", "2001:db8::11/128"]
    assert control_plane([], "[2001:db8::10]:6379", "postgresql://[2001:db8::12]/c", "::") == [
        "2001:db8::10/128",
        "2001:db8::12/128",
    ]
    # Loopback is always denied; a name that does not resolve is left out.
    assert (
        control_plane(["127.0.0.1"], "127.0.0.1:1", "postgresql:///c", "no-such-host.invalid") == []
    )
    spec = NodeSpec(node="n0", data_dir="/tmp/x", host="192.0.2.10", port=1, state="s",
                    node_key="k", deny=deny)  # fmt: skip
    assert spec.config().network_deny == deny
