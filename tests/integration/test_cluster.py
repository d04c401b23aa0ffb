"""A cluster of processes on this machine: PostgreSQL, three node agents
heartbeating into it, and a gateway in front. Placement, quotas, bad ids,
idempotent retries, and the faults issue 6 names, each with its outcome
(docs/cluster.md): a node that stops heartbeating, PostgreSQL restarted
mid-burst, a gateway killed mid-request."""

from __future__ import annotations

import asyncio
import secrets
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import corral
from corral.errors import (
    InvalidArgument,
    ResourceExhausted,
    SandboxLost,
    SandboxNotFound,
    Unauthenticated,
)

from ..framework import IMAGE, Cluster

pytestmark = [pytest.mark.slow, pytest.mark.requires_postgres]
SPEC: dict[str, Any] = {"image": IMAGE, "memory": "256MiB", "cpu": 0.25}


@pytest.fixture(scope="module")
def cluster(data_root: Path) -> Iterator[Cluster]:
    c = Cluster(data_root / "pc", nodes=3, node_timeout=3.0)
    try:
        c.start()
        yield c
    finally:
        c.stop()
    # Nothing of the cluster may stay: mounts, cgroups, sockets, OCI state, processes.
    assert {n.name: n.leftovers() for n in c.nodes} == {n.name: {} for n in c.nodes}
    shutil.rmtree(c.root, ignore_errors=True)


@pytest.fixture(scope="module")
def keys(cluster: Cluster) -> dict[str, str]:
    """org (6 sandboxes) > team (4 CPUs) > job; and another org."""
    return {
        "org": cluster.project("org", max_sandboxes=6),
        "team": cluster.project("team", parent="org", max_cpu=4),
        "job": cluster.project("job", parent="team"),
        "other": cluster.project("other"),
    }


def _node_of(sandbox_id: str) -> str:
    return sandbox_id.split("-", 1)[0]


async def test_creates_spread_over_the_nodes_and_are_reached_through_the_gateway(
    cluster: Cluster, keys: dict[str, str]
) -> None:
    # 12 at once: every create sees the others in flight, so power-of-two
    # choices spreads them (a node left empty has odds below 1 in 20,000).
    async with cluster.client(keys["other"]) as c:
        made = await c.sandboxes.create_many(SPEC, count=12, key="spread")
        sbxs = [s for s in made if isinstance(s, corral.AsyncSandbox)]
        assert len(sbxs) == 12, made
        assert {_node_of(s.id) for s in sbxs} == {"k0", "k1", "k2"}
        for s in sbxs:
            r = await s.commands.run(f"echo {s.id}")
            assert r.exit_code == 0 and r.stdout.strip() == s.id
        await sbxs[0].files.write("/tmp/x", b"through the gateway")
        assert await sbxs[0].files.read("/tmp/x") == b"through the gateway"
        assert sorted(s.id for s in await c.sandboxes.list()) == sorted(s.id for s in sbxs)
        assert cluster.used("other") == (12, 3.0, 12 * 256 * 2**20)
        await asyncio.gather(*(s.close() for s in sbxs))
    assert cluster.used("other") == (0, 0.0, 0)
    for n in cluster.nodes:
        assert await cluster.held(n) == []


async def test_a_retried_create_many_makes_no_duplicates(
    cluster: Cluster, keys: dict[str, str]
) -> None:
    async with cluster.client(keys["job"]) as c:
        first = await c.sandboxes.create_many(SPEC, count=4, key="retry")
        again = await c.sandboxes.create_many(SPEC, count=4, key="retry")
        ids = [s.id for s in first if isinstance(s, corral.AsyncSandbox)]
        assert len(ids) == 4 and ids == [s.id for s in again if isinstance(s, corral.AsyncSandbox)]
        assert cluster.used("org")[0] == 4
        held = await cluster.held_everywhere()
        assert sorted(held) == sorted(ids)
        # The same key in another project is another sandbox.
        async with cluster.client(keys["other"]) as o:
            (theirs,) = await o.sandboxes.create_many(SPEC, count=1, key="retry")
            assert isinstance(theirs, corral.AsyncSandbox) and theirs.id not in ids
            await theirs.close()
        await asyncio.gather(*(s.close() for s in first if isinstance(s, corral.AsyncSandbox)))
    assert cluster.used("org") == (0, 0.0, 0)


async def test_nested_quotas_refuse_at_the_level_that_is_full(
    cluster: Cluster, keys: dict[str, str]
) -> None:
    async with cluster.client(keys["job"]) as c:
        # team allows 4 CPUs: the third 2-CPU sandbox is refused by the team.
        out = await c.sandboxes.create_many({**SPEC, "cpu": 2}, count=3, key="cpu", concurrency=1)
        assert [type(r).__name__ for r in out] == [
            "AsyncSandbox",
            "AsyncSandbox",
            "ResourceExhausted",
        ]
        err = out[2]
        assert isinstance(err, ResourceExhausted)
        assert (err.details["project"], err.details["resource"]) == ("team", "cpu")
        assert "ancestor of 'job'" in err.message
        for r in out[:2]:
            assert isinstance(r, corral.AsyncSandbox)
            await r.close()
        # org allows 6 sandboxes (the job and team set none): the 7th is refused.
        more = await c.sandboxes.create_many(SPEC, count=7, key="count", concurrency=2)
        refused = [r for r in more if isinstance(r, ResourceExhausted)]
        assert len(refused) == 1 and refused[0].details["project"] == "org", refused
        assert refused[0].details["resource"] == "sandboxes"
        assert cluster.used("org")[0] == 6 and cluster.used("other")[0] == 0
        await asyncio.gather(*(r.close() for r in more if isinstance(r, corral.AsyncSandbox)))
    assert cluster.used("org") == (0, 0.0, 0)
    assert cluster.used("team") == (0, 0.0, 0)


async def test_concurrent_creates_never_overrun_a_quota(cluster: Cluster) -> None:
    key = cluster.project("tight", max_sandboxes=5)
    async with cluster.client(key) as c:
        out = await c.sandboxes.create_many(SPEC, count=16, key="race", concurrency=16)
        made = [r for r in out if isinstance(r, corral.AsyncSandbox)]
        refused = [r for r in out if isinstance(r, ResourceExhausted)]
        assert (len(made), len(refused)) == (5, 11), out
        assert cluster.used("tight")[0] == 5
        await asyncio.gather(*(s.close() for s in made))
    assert cluster.used("tight") == (0, 0.0, 0)


@pytest.mark.requires_qemu
async def test_a_fork_through_the_gateway_is_charged_and_routed(cluster: Cluster) -> None:
    """Copies land on the source's node, each with its own row and charge;
    a fork the quota cannot hold is refused whole, charging nothing."""
    key = cluster.project("forks", max_sandboxes=3)
    async with cluster.client(key) as c:
        src = await c.sandboxes.create(kind="microvm", image=IMAGE, memory="256MiB")
        await src.files.write("/work/x", b"from the source")
        with pytest.raises(ResourceExhausted):
            await c.sandboxes.fork(src, 3)  # 1 + 3 > 3
        assert cluster.used("forks")[0] == 1
        copies = await c.sandboxes.fork(src, 2, idempotency_key="f1")
        assert {x.info.node for x in copies} == {src.info.node}
        assert cluster.used("forks")[0] == 3
        again = await c.sandboxes.fork(src, 2, idempotency_key="f1")  # a retry
        assert [x.id for x in again] == [x.id for x in copies]
        for x in copies:
            assert await x.files.read("/work/x") == b"from the source"
        listed = {x.id for x in await c.sandboxes.list()}
        assert listed == {src.id, *(x.id for x in copies)}
        await asyncio.gather(*(x.close() for x in [src, *copies]))
    assert cluster.used("forks") == (0, 0.0, 0)


async def test_a_fork_asked_from_above_belongs_to_the_sources_project(
    cluster: Cluster, keys: dict[str, str]
) -> None:
    """A project above may fork its child's sandbox; the copies are the
    child's, as their copied labels say (before, the row was the parent's
    and the labels the child's: the child listed sandboxes it did not own,
    and a save of one was the child's to restore)."""
    async with cluster.client(keys["job"]) as c, cluster.client(keys["org"]) as org:
        src = await c.sandboxes.create(**SPEC)
        (copy,) = await org.sandboxes.fork(await org.sandboxes.get(src.id), 1)
        assert copy.info.labels["corral.project"] == "job"
        assert copy.id in {x.id for x in await c.sandboxes.list()}
        assert (await c.sandboxes.get(copy.id)).id == copy.id
        await asyncio.gather(copy.close(), src.close())


@pytest.mark.parametrize(
    "kind", ["container", pytest.param("microvm", marks=pytest.mark.requires_qemu)]
)
async def test_a_saved_sandbox_is_restored_through_the_gateway(
    cluster: Cluster, tmp_path: Path, kind: str
) -> None:
    """Placed and charged like a create; the copy has the saved files."""
    key = cluster.project(f"saves-{kind}", max_sandboxes=2)
    async with cluster.client(key) as c:
        src = await c.sandboxes.create(kind=kind, image=IMAGE, memory="256MiB")
        await src.files.write("/work/x", b"saved")
        saved = await src.save()
        assert saved.project == f"saves-{kind}"
        moved = await c.sandboxes.restore(saved, idempotency_key="r1")
        assert cluster.used(f"saves-{kind}")[0] == 2
        assert (await c.sandboxes.restore(saved, idempotency_key="r1")).id == moved.id
        assert await moved.files.read("/work/x") == b"saved"
        with pytest.raises(ResourceExhausted):
            await c.sandboxes.restore(saved)  # a third sandbox: over the quota
        await asyncio.gather(src.close(), moved.close())
    assert cluster.used(f"saves-{kind}") == (0, 0.0, 0)


BAD_IDS = [
    ("k0-0123456789abcdef", SandboxNotFound, "no sandbox k0-0123456789abcdef"),
    ("zz-0123456789abcdef", SandboxNotFound, "node 'zz' is not a member"),
    ("k0-0123", InvalidArgument, "sandbox_id"),
    ("K0-0123456789ABCDEF", InvalidArgument, "sandbox_id"),
    ("..", InvalidArgument, "sandbox_id"),
]


@pytest.mark.parametrize(("sid", "exc", "text"), BAD_IDS)
async def test_bad_ids_get_a_defined_error(
    cluster: Cluster, keys: dict[str, str], sid: str, exc: type, text: str
) -> None:
    async with cluster.client(keys["job"]) as c:
        with pytest.raises(exc, match=text):
            await c.sandboxes.get(sid)


async def test_another_projects_sandbox_is_not_found_and_unharmed(
    cluster: Cluster, keys: dict[str, str]
) -> None:
    async with cluster.client(keys["other"]) as o, cluster.client(keys["job"]) as c:
        theirs = await o.sandboxes.create(**SPEC)
        with pytest.raises(SandboxNotFound) as err:
            await c.sandboxes.get(theirs.id)
        assert "not a member" not in err.value.message  # same answer as a forged id
        with pytest.raises(SandboxNotFound):  # closing by id: no handle to get
            await c.service.close(theirs.id)
        assert (await theirs.commands.run("true")).exit_code == 0
        # The org owns the team and the job, not the other org.
        async with cluster.client(keys["org"]) as org:
            mine = await c.sandboxes.create(**SPEC)
            assert (await org.sandboxes.get(mine.id)).id == mine.id
            with pytest.raises(SandboxNotFound):
                await org.sandboxes.get(theirs.id)
            await mine.close()
        await theirs.close()


async def test_a_projects_commits_are_its_own_and_the_operators_images_no_ones(
    cluster: Cluster, keys: dict[str, str]
) -> None:
    """A node's image store is shared by every project on it: through a
    gateway a commit is named under projects/<project>/ (before, a commit
    tagged like the base image replaced it for every project), and no
    other project names it."""
    async with cluster.client(keys["other"]) as o, cluster.client(keys["job"]) as c:
        sbx = await o.sandboxes.create(**SPEC)
        await sbx.files.write("/planted", "theirs")
        for tag in (IMAGE, "projects/job/x:1", "projects/otherwise/x:1"):
            with pytest.raises(InvalidArgument, match="must start with 'projects/other/'") as err:
                await sbx.commit(tag)
            assert err.value.field == "tag"
        # A label a node finds its own layers by (a pulled OCI layer's chain
        # id) would make this the next pull's layer, for every project.
        with pytest.raises(InvalidArgument, match="platform finds its own layers") as err:
            await sbx.commit("projects/other/x:1", labels={"oci.chain_id": "sha256:" + "a" * 64})
        assert err.value.field == "labels.oci.chain_id"
        ours = await sbx.commit("projects/other/planted:1")
        assert ours.digest.startswith("sha256:")
        copy = await o.sandboxes.create(**{**SPEC, "image": "projects/other/planted:1"})
        assert await copy.files.read_text("/planted") == "theirs"
        base = await o.sandboxes.create(**SPEC)  # the operator's image, as it was
        with pytest.raises(corral.FileNotFound):
            await base.files.read_text("/planted")
        for field, spec in (
            ("image", {**SPEC, "image": "projects/other/planted:1"}),
            ("toolkit.0", {**SPEC, "toolkit": ["projects/other/planted:1"]}),
            # A VM's own disk added for one project (corral disk add --project).
            ("image", {**SPEC, "kind": "fullvm", "image": "disk:projects/other/win11"}),
        ):
            with pytest.raises(InvalidArgument, match="another project's images") as err:
                await c.sandboxes.create(**spec)
            assert err.value.field == field
        # By digest, its layer is one the node lacks, for another project:
        # the node labelled the commit with the project that made it.
        assert ours.labels["corral.project"] == "other"
        for field, spec in (
            ("image", {**SPEC, "image": ours.digest}),
            ("toolkit[0]", {**SPEC, "toolkit": [ours.digest]}),
        ):
            with pytest.raises(corral.ImageNotFound, match="is not in this node's store") as found:
                await c.sandboxes.create(**spec)
            assert found.value.details["field"] == field
        with pytest.raises(corral.ImageNotFound, match="is not in this node's store"):
            await c.fncall.run("python", "print(open('/planted').read())", image=ours.digest)
        # Its own project reads it by digest.
        again = await o.sandboxes.create(**{**SPEC, "toolkit": [ours.digest]})
        assert await again.files.read_text("/planted") == "theirs"
        # A project's own layers are listed and deleted through the gateway,
        # on every node; the operator's and another project's are not.
        listed = await o.service.list_layers()  # the store is the machine's: earlier runs' too
        assert ours.digest in {x.digest for x in listed}
        assert {x.labels["corral.project"] for x in listed} == {"other"}
        assert await c.service.list_layers() == []
        for ref, error in ((IMAGE, InvalidArgument), ("projects/other/planted:1", InvalidArgument),
                           (ours.digest, corral.ImageNotFound)):  # fmt: skip
            with pytest.raises(error):
                await c.service.delete_layer(ref)
        with pytest.raises(corral.Conflict):  # a sandbox runs on it
            await o.service.delete_layer("projects/other/planted:1")
        # A parent's key on its child's sandbox: the layer would be the
        # child's (its node labels it so) under the parent's name.
        childs = await c.sandboxes.create(**SPEC)
        async with cluster.client(keys["org"]) as org:
            with pytest.raises(InvalidArgument, match="sandbox of the committing") as err:
                await (await org.sandboxes.get(childs.id)).commit("projects/org/x:1")
            assert err.value.field == "sandbox_id"
        for s in (sbx, copy, base, again, childs):
            await s.close()
        # A sandbox of the node's own (an operator's, a warm pool's) on the
        # last node asked: the nodes share this machine's store, so a delete
        # from the first node would have taken the layer from under it.
        async with cluster.node_client(cluster.node("k2")) as k2:
            held = await k2.sandboxes.create(**{**SPEC, "image": ours.digest})
            assert [
                x.in_use for x in await k2.service.list_layers() if x.digest == ours.digest
            ] == [True]
            listed = await o.service.list_layers()  # one entry, in use where any node uses it
            assert [x.in_use for x in listed if x.digest == ours.digest] == [True]
            with pytest.raises(corral.Conflict, match=r"in use on nodes k2\b.*nothing deleted"):
                await o.service.delete_layer(ours.digest)
            assert await held.files.read_text("/planted") == "theirs"
            await held.close()
        await o.service.delete_layer(ours.digest)
        assert ours.digest not in {x.digest for x in await o.service.list_layers()}


@pytest.mark.parametrize(
    ("labels", "field"),
    [
        ({"corral.project": "other"}, "labels.corral.project"),
        ({"corral.key": "x"}, "labels.corral.key"),
    ],
)
async def test_reserved_labels_are_refused_before_anything_is_charged(
    cluster: Cluster, keys: dict[str, str], labels: dict[str, str], field: str
) -> None:
    before = cluster.rows()
    async with cluster.client(keys["job"]) as c:
        with pytest.raises(InvalidArgument) as err:
            await c.sandboxes.create(image=IMAGE, labels=labels)
    assert err.value.field == field
    assert cluster.rows() == before and cluster.used("org") == (0, 0.0, 0)


async def test_a_teams_key_mints_lists_and_revokes_a_jobs_key_on_postgresql(
    cluster: Cluster, keys: dict[str, str]
) -> None:
    """control/keys.py on the cluster's PostgreSQL (schema 5, the subtree
    walk, the id lookup), through the gateway's HTTP API."""
    async with cluster.client(keys["team"]) as team:
        job = await team.keys.create(project="job", expires="1h", note="run 7")
        assert job.api_key is not None
        async with cluster.client(job.api_key) as c:
            sbx = await c.sandboxes.create(**SPEC)
            await sbx.close()
        listed = {k.id: k for k in await team.keys.list()}
        assert {k.project for k in listed.values()} == {"team", "job"}
        assert listed[job.id].last_used_at is not None
        with pytest.raises(corral.NotFound):
            await team.keys.list("other")
        await team.keys.revoke(job.id)
        async with cluster.client(job.api_key) as c:
            with pytest.raises(corral.Unauthenticated, match="revoked"):
                await c.sandboxes.list()


@pytest.mark.parametrize("key", ["", "ck_forged", "nk-00000000"])
async def test_a_bad_api_key_is_refused(cluster: Cluster, key: str) -> None:
    # The nodes' own key is not a project key: it opens no door on the gateway.
    async with cluster.client(key) as c:
        with pytest.raises(Unauthenticated):
            await c.sandboxes.list()


async def test_a_node_that_stops_heartbeating_is_lost_and_reconciled_when_back(
    cluster: Cluster, keys: dict[str, str]
) -> None:
    async with cluster.client(keys["job"]) as c:
        made = await c.sandboxes.create_many(SPEC, count=6, key="stop")
        sbxs = [s for s in made if isinstance(s, corral.AsyncSandbox)]
        lost_node = _node_of(sbxs[0].id)
        victim = cluster.node(lost_node)
        on_victim = [s for s in sbxs if _node_of(s.id) == lost_node]
        elsewhere = [s for s in sbxs if _node_of(s.id) != lost_node]
        assert on_victim and elsewhere
        victim.server.send(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            while True:
                try:
                    await on_victim[0].refresh()
                except SandboxLost as exc:
                    lost_after = time.monotonic() - stopped
                    assert lost_node in exc.message
                    break
                assert time.monotonic() - stopped < 30, "the node was never marked lost"
                await asyncio.sleep(0.2)
            # Bounded: the timeout, a sweep interval and a heartbeat interval.
            assert lost_after < cluster.node_timeout + 4, lost_after
            for s in on_victim:
                with pytest.raises(SandboxLost):
                    await s.commands.run("true")
            # The lost sandboxes' quota is back; the others work on.
            assert cluster.used("org")[0] == len(elsewhere)
            for s in elsewhere:
                assert (await s.commands.run("true")).exit_code == 0
            # New creates avoid the lost node.
            fresh = await c.sandboxes.create(**SPEC)
            assert _node_of(fresh.id) != lost_node
        finally:
            victim.server.send(signal.SIGCONT)
        # Back: alive again, and what it still holds for written-off
        # sandboxes is closed on it (not resurrected).
        cluster.wait_alive([lost_node])
        deadline = time.monotonic() + 30
        while await cluster.held(victim):
            assert time.monotonic() < deadline, "the returning node was not reconciled"
            await asyncio.sleep(0.5)
        for s in on_victim:
            await s.close()  # acknowledges the loss; nothing left to release
        for s in [*elsewhere, fresh]:
            await s.close()
    assert cluster.used("org") == (0, 0.0, 0)
    assert cluster.rows().get("lost", 0) == 0


async def _burst_started(
    c: corral.AsyncClient, n: int, key: str, **kw: float
) -> asyncio.Task[list[corral.AsyncSandbox | corral.CorralError]]:
    """A create_many of n running in the background, once 3 are ready."""
    ready, started = 0, asyncio.Event()

    def seen(_i: int, _r: object) -> None:
        nonlocal ready
        ready += 1
        if ready >= 3:
            started.set()

    burst = asyncio.create_task(
        c.sandboxes.create_many(SPEC, count=n, key=key, concurrency=4, on_ready=seen, **kw)
    )
    await started.wait()
    return burst


async def test_postgres_restarted_mid_burst_loses_nothing_and_duplicates_nothing(
    cluster: Cluster, keys: dict[str, str]
) -> None:
    n = 24
    async with cluster.client(keys["other"]) as c:
        burst = await _burst_started(c, n, "pg")
        await asyncio.to_thread(cluster.pg.restart)
        out = await burst
        failed = [r for r in out if not isinstance(r, corral.AsyncSandbox)]
        assert failed == [], failed
        ids = sorted(s.id for s in out if isinstance(s, corral.AsyncSandbox))
        assert len(set(ids)) == n
        held = await cluster.held_everywhere()
        assert held == ids  # no sandbox made twice, none made and forgotten
        assert cluster.used("other")[0] == n
        # The outage was not mistaken for dead nodes.
        assert set(cluster.node_states().values()) == {"alive"}
        await asyncio.gather(*(s.close() for s in out if isinstance(s, corral.AsyncSandbox)))
    assert cluster.used("other") == (0, 0.0, 0)


async def test_a_gateway_killed_mid_request_loses_nothing(
    cluster: Cluster, keys: dict[str, str]
) -> None:
    gw = cluster.gateway
    assert gw is not None and gw.proc is not None
    n = 12
    async with cluster.client(keys["other"]) as c:
        # No automatic retry: what a client sees when its gateway dies.
        burst = await _burst_started(c, n, "gw", retry_for=0)
        gw.kill(signal.SIGKILL)
        first = await burst
        assert any(isinstance(r, corral.Unavailable) for r in first)
        gw.start()  # a new replica on the same port and store
        # The same key again: the sandboxes the dead replica made are found
        # (adopted from their nodes where it died before recording them).
        again = await c.sandboxes.create_many(SPEC, count=n, key="gw")
        ids = [s.id for s in again if isinstance(s, corral.AsyncSandbox)]
        assert len(ids) == n
        made_first = [r.id for r in first if isinstance(r, corral.AsyncSandbox)]
        assert set(made_first) <= set(ids)
        held = await cluster.held_everywhere()
        assert held == sorted(ids)
        assert cluster.used("other")[0] == n
        await asyncio.gather(*(s.close() for s in again if isinstance(s, corral.AsyncSandbox)))
    assert cluster.used("other") == (0, 0.0, 0)


async def test_a_closed_sandboxs_key_is_not_reused(cluster: Cluster, keys: dict[str, str]) -> None:
    async with cluster.client(keys["job"]) as c:
        s = await c.sandboxes.create(**SPEC, idempotency_key="once")
        await s.close()
        with pytest.raises(corral.Conflict, match="was closed"):
            await c.sandboxes.create(**SPEC, idempotency_key="once")
        # As on a node: a closed sandbox still answers get(), as closed.
        assert (await c.sandboxes.get(s.id)).info.state.value == "closed"
        with pytest.raises(corral.SandboxClosed):
            await s.commands.run("true")


async def test_rollouts_and_suspends_through_the_gateway_belong_to_the_project(
    cluster: Cluster, keys: dict[str, str]
) -> None:
    async with cluster.client(keys["job"]) as c, cluster.client(keys["other"]) as o:
        made = await c.sandboxes.create_many({**SPEC, "labels": {"pre": "j"}}, count=3, key="pre")
        theirs = await o.sandboxes.create(**{**SPEC, "labels": {"pre": "j"}})
        out = await c.sandboxes.suspend_many({"pre": "j"}, key="pre")
        assert sorted(x.id for x in out) == sorted(s.id for s in made)  # type: ignore[union-attr]
        assert all(x.ok and x.info and x.info.state == "suspended" for x in out)
        assert (await o.sandboxes.get(theirs.id)).info.state == "running"
        # A rollout's log is in the state store (PostgreSQL), by project.
        r = await c.rollouts.open("shared-name")
        sbx = await r.attach(made[0].id)  # type: ignore[union-attr]
        assert (await sbx.commands.run("echo $((20+1))")).stdout == "21\n"  # resumes it
        again = await c.rollouts.open("shared-name")
        assert again.logged == 2
        assert (await o.rollouts.open("shared-name")).logged == 0
        await c.rollouts.delete("shared-name")
        await asyncio.gather(*(s.close() for s in made if isinstance(s, corral.AsyncSandbox)))
        await theirs.close()


MOUNT = "python3 -c \"import ctypes; ctypes.CDLL(None).mount(b'x', b'/mnt', b'tmpfs', 0, None)\""


async def test_reports_and_events_through_the_gateway_stay_in_the_project(
    cluster: Cluster, keys: dict[str, str]
) -> None:
    name = f"gw-report-{secrets.token_hex(4)}"
    async with cluster.client(keys["job"]) as c, cluster.client(keys["other"]) as o:
        stream = await c.events()
        try:
            rollout = await c.rollouts.open(name)
            sbx = await rollout.create(**SPEC)
            await sbx.commands.run(MOUNT)
            # Another project's sandbox with the same rollout label: not ours.
            theirs = await o.sandboxes.create(**{**SPEC, "labels": {"corral.rollout": name}})
            await theirs.commands.run(MOUNT)
            await sbx.close()
            await theirs.close()
            seen: list[corral.Event] = []
            while not any(e.kind == "state" and e.state == "closed" for e in seen):
                event = await stream.next(timeout=30)
                assert event is not None, seen
                seen.append(event)
        finally:
            await stream.close()
        report = await c.rollouts.report(name)
        assert report.sandboxes == [sbx.id] and report.verdict == "suspicious"
        assert {f.kind for f in report.findings} == {"syscall_denied"}
        assert {e.sandbox for e in seen} == {sbx.id}
        assert any(e.kind == "finding" for e in seen)
        assert (await o.rollouts.report(name)).sandboxes == [theirs.id]


async def test_a_rollout_follows_its_sandbox_to_another_node(cluster: Cluster) -> None:
    """A preempted job moved: its sandbox saved and restored elsewhere (a
    new id), the original closed. The trainer run again replays its log
    onto the restored copy, and the step that was in flight (ran, never
    logged) is answered from the record that moved with it, not run twice."""
    key = cluster.project("moves", max_sandboxes=3)
    bump = "n=$(cat /tmp/n 2>/dev/null || echo 0); echo $((n+1)) > /tmp/n; cat /tmp/n"
    async with cluster.client(key) as c:
        r = await c.rollouts.open("moving")
        sbx = await r.create(image=IMAGE, memory="128MiB")
        assert (await sbx.commands.run(bump)).stdout == "1\n"
        # Step 2 ran on the node, and the trainer died before logging it.
        assert (await sbx.sandbox.commands.run(bump, key="moving.2")).stdout == "2\n"
        saved = await sbx.sandbox.save()
        moved = await c.sandboxes.restore(saved)
        await sbx.sandbox.close()
        again = await c.rollouts.open("moving")
        rs = await again.create(image=IMAGE, memory="128MiB")
        assert rs.id == moved.id != sbx.id
        assert (await rs.commands.run(bump)).stdout == "1\n"  # from the log
        assert (await rs.commands.run(bump)).stdout == "2\n"  # from the moved record
        assert (await rs.commands.run(bump)).stdout == "3\n"  # live, once
        assert (await moved.files.read_text("/tmp/n")) == "3\n"
        await moved.close()
        await c.rollouts.delete("moving")
    assert cluster.used("moves") == (0, 0.0, 0)


async def test_e2bs_sdk_works_through_the_gateway_within_its_project(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stock e2b SDK with a project's key against the gateway: E2B's
    control API is the project's, envd calls reach the sandbox's node with
    the sandbox's own token, and another project sees none of it."""
    e2b = pytest.importorskip("e2b", reason="the e2b package (a dev dependency) is missing")
    assert cluster.gateway is not None
    url = cluster.gateway.url
    key, other = cluster.project("e2b-a", max_sandboxes=2), cluster.project("e2b-b")
    for k, v in {"E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": key,
                 "E2B_VALIDATE_API_KEY": "false", "E2B_DOMAIN": "corral.local"}.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    s = await e2b.AsyncSandbox.create("base", timeout=120, metadata={"who": "a"})
    try:
        assert _node_of(s.sandbox_id) in {n.name for n in cluster.nodes}
        assert (await s.commands.run("whoami")).stdout == "user\n"
        cat = await s.commands.run("cat", background=True, stdin=True)
        await s.commands.send_stdin(cat.pid, "through the gateway")
        await s.commands.close_stdin(cat.pid)
        assert (await cat.wait()).stdout == "through the gateway"
        await s.files.write("a.txt", "on its node")
        assert await s.files.read("a.txt") == "on its node"
        await s.set_timeout(60)
        theirs = e2b.AsyncSandbox.list(api_key=other)
        assert await theirs.next_items() == []
        with pytest.raises(e2b.NotFoundException):
            await e2b.AsyncSandbox.get_info(s.sandbox_id, api_key=other)
        assert not await e2b.AsyncSandbox.kill(s.sandbox_id, api_key=other)
        assert cluster.used("e2b-a")[0] == 1
        # A snapshot is the project's own layer: its id as embedded, its
        # tag under the project's names; listed, started and deleted for
        # the project alone.
        snap = await s.create_snapshot(name="snap_a")
        assert snap.snapshot_id == "snapshots:snap_a"
        mine = await e2b.AsyncSandbox.list_snapshots(name="snap_a").next_items()
        assert [x.snapshot_id for x in mine] == ["snapshots:snap_a"]
        assert await e2b.AsyncSandbox.list_snapshots(api_key=other).next_items() == []
        with pytest.raises(e2b.SandboxException, match="not found"):  # another project's
            await e2b.AsyncSandbox.create(snap.snapshot_id, timeout=60, api_key=other)
        assert not await e2b.AsyncSandbox.delete_snapshot(snap.snapshot_id, api_key=other)
    finally:
        assert await s.kill()
    again = await e2b.AsyncSandbox.create(snap.snapshot_id, timeout=120)
    try:
        assert await again.files.read("a.txt") == "on its node"
    finally:
        assert await again.kill()
    assert await e2b.AsyncSandbox.delete_snapshot(snap.snapshot_id)
    assert not await e2b.AsyncSandbox.delete_snapshot(snap.snapshot_id)
    assert await e2b.AsyncSandbox.list_snapshots().next_items() == []
    assert cluster.used("e2b-a") == (0, 0.0, 0)
