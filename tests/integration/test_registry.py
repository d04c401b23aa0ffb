"""Images from an OCI registry: a real one on loopback (Debian's
docker-registry), images made here and pushed to it with skopeo, pulled by
Corral (images/pull.py) into stacks of layers that sandboxes start from,
and everything a bad pull can meet."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import logging
import os
import shutil
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import corral
from corral.images import pull as pull_module
from corral.images.egress import PullGuard
from corral.images.pull import pull
from corral.images.store import ImageStore

from ..framework import Node
from ..framework.registry import Registry, certs_dir, oci_image, trusted_cert

BASE: list[dict[str, bytes | None]] = [
    {"etc": None, "etc/a.txt": b"a\n", "etc/b.txt": b"b\n", "opq": None, "opq/old": b"x"},
]
TOP = {"etc": None, "etc/.wh.a.txt": b"", "opq": None, "opq/.wh..wh..opq": b"", "opq/new": b"y"}
CONFIG = {"Env": ["PATH=/usr/bin:/bin", "HELLO=from-the-image"], "WorkingDir": "/etc"}


def _quiet(task: str, done: float, total: float | None) -> None:
    pass


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    reg = Registry(tmp_path / "registry")
    reg.start()
    yield reg
    reg.stop()


@pytest.fixture
def store(node: Node) -> Iterator[ImageStore]:
    """The node's store; what a test pulled is dropped after it."""
    images = ImageStore(node.config.images_dir)
    before = {x.digest for x in images.list()}
    yield images
    for name in images.names():
        if name.startswith("127.0.0.1_"):
            images.untag(name)
    for layer in images.list():
        if layer.digest not in before:
            for name in layer.names:
                images.untag(name)
            images.remove(layer.digest)


def push(registry: Registry, tmp: Path, name: str, layers: list[Any], config: Any) -> Any:
    made = oci_image(tmp / name.replace("/", "_").replace(":", "_"), layers, config)
    registry.push(tmp / name.replace("/", "_").replace(":", "_"), name)
    return made


async def test_a_pulled_image_is_a_stack_sandboxes_start_from(
    node: Node, registry: Registry, store: ImageStore, tmp_path: Path
) -> None:
    push(registry, tmp_path, "team/app:1", [*BASE, TOP], CONFIG)
    ref = f"{registry.host}/team/app:1"
    top = await asyncio.to_thread(pull, store, ref, _quiet)
    chain = store.chain(top)
    assert len(chain) == 3  # two OCI layers and the config on top
    assert top.names == [f"127.0.0.1_{registry.port}/team/app:1"]
    async with node.client() as c:
        sbx = await c.sandboxes.create(image=ref)
        try:
            # The top layer's whiteout and opaque directory hide the base's files.
            assert not await sbx.files.exists("/etc/a.txt")
            assert await sbx.files.read("/etc/b.txt") == b"b\n"
            assert not await sbx.files.exists("/opq/old")
            assert await sbx.files.read("/opq/new") == b"y"
            r = await sbx.commands.run("echo $HELLO; pwd")
            assert r.stdout == "from-the-image\n/etc\n", r
        finally:
            await sbx.close()


async def test_images_sharing_layers_share_them_and_a_repull_fetches_nothing(
    registry: Registry, store: ImageStore, tmp_path: Path
) -> None:
    push(registry, tmp_path, "team/app:1", [*BASE, TOP], CONFIG)
    push(registry, tmp_path, "team/other:1", [*BASE, {"other": b"1"}], {"Env": []})
    first = await asyncio.to_thread(pull, store, f"{registry.host}/team/app:1", _quiet)
    count = len(store.list())
    other = await asyncio.to_thread(pull, store, f"{registry.host}/team/other:1", _quiet)
    assert len(store.list()) == count + 2  # its own top layer and config; the base is shared
    assert store.chain(first)[0].digest == store.chain(other)[0].digest
    again = await asyncio.to_thread(pull, store, f"{registry.host}/team/app:1", _quiet)
    assert again.digest == first.digest and len(store.list()) == count + 2


async def test_the_first_create_pulls_once_for_a_burst(
    node: Node, registry: Registry, store: ImageStore, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    push(registry, tmp_path, "team/burst:1", [*BASE, TOP], CONFIG)
    ref = f"{registry.host}/team/burst:1"
    caplog.set_level(logging.INFO, logger="corral.node")
    async with node.client() as c:
        boxes = await c.sandboxes.create_many({"image": ref}, 6, concurrency=6)
        try:
            assert all(isinstance(b, corral.AsyncSandbox) for b in boxes), boxes
        finally:
            await asyncio.gather(*(b.close() for b in boxes if isinstance(b, corral.AsyncSandbox)))
    pulls = [r for r in caplog.records if "image.pulled" in r.getMessage()]
    assert len(pulls) == 1, [r.getMessage() for r in pulls]


async def test_bad_pulls_are_clear_and_leave_nothing(
    node: Node, registry: Registry, store: ImageStore, tmp_path: Path
) -> None:
    # Content of this test's own, so no cache (the node's OCI layout) holds it.
    made = push(registry, tmp_path, "team/app:1", [*BASE, {**TOP, "id": os.urandom(16)}], CONFIG)
    layers, names = len(store.list()), store.names()
    tmp_before = set(os.listdir(store.tmp))

    def attempt(ref: str) -> corral.CorralError:
        with pytest.raises(corral.CorralError) as err:
            pull(store, ref, _quiet)
        return err.value

    dead = attempt("127.0.0.1:9/team/app:1")  # nothing listens on port 9
    assert isinstance(dead, corral.Unavailable) and "127.0.0.1:9" in dead.message, dead
    missing = attempt(f"{registry.host}/team/app:nope")
    assert isinstance(missing, corral.ImageNotFound), missing
    wrong = attempt(f"{registry.host}/team/app@sha256:{'0' * 64}")
    assert isinstance(wrong, corral.ImageNotFound), wrong
    bad = attempt(f"{registry.host}/Team/App:1")
    assert isinstance(bad, corral.InvalidArgument) and bad.details["field"] == "ref", bad
    # A layer the registry serves truncated: its digest does not match.
    blob = registry.blob_file(made["layers"][1])
    blob.write_bytes(blob.read_bytes()[:20])
    truncated = attempt(f"{registry.host}/team/app:1")
    assert "digest" in truncated.message.lower() or "match" in str(truncated).lower(), truncated
    assert len(store.list()) == layers and store.names() == names  # no partial layer or tag
    assert set(os.listdir(store.tmp)) == tmp_before
    async with node.client() as c:  # and a create says which image, by field
        with pytest.raises(corral.ImageNotFound):
            await c.sandboxes.create(image=f"{registry.host}/team/nothing:1")
        with pytest.raises(corral.InvalidArgument) as err:
            await c.sandboxes.create(image="127.0.0.1:5000/Bad Name:1")
        assert err.value.details["field"] == "image"


def _dns(host: str, port: int) -> list[str]:
    """What a hostile name server says of mirror.corp: the node's loopback."""
    return ["127.0.0.1"] if host == "mirror.corp" else []


async def test_a_guarded_pull_goes_only_where_its_guard_lets_it(
    node: Node, store: ImageStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """skopeo reaches an HTTPS registry only through the node's guard
    (images/egress.py): a name that resolves inside is refused whatever it
    is, and the operator's listed registry is pulled through the tunnel."""
    reg = Registry(tmp_path / "tls", tls_name="mirror.corp")
    try:
        reg.start()
        push(reg, tmp_path, "team/app:1", [*BASE, TOP], CONFIG)
        ref = f"mirror.corp:{reg.port}/team/app:1"
        with (
            PullGuard(resolve=_dns) as guard,
            pytest.raises(corral.InvalidArgument, match="resolves to an address inside") as err,
        ):
            await asyncio.to_thread(pull, store, ref, _quiet, guard=guard)
        assert err.value.details["field"] == "ref" and guard.refused
        monkeypatch.setenv("CORRAL_REGISTRIES", f"mirror.corp:{reg.port}")
        with PullGuard(resolve=_dns) as guard:
            top = await asyncio.to_thread(pull, store, ref, _quiet, guard=guard)
        assert len(store.chain(top)) == 3 and not guard.refused
    finally:
        reg.stop()


@pytest.fixture
def steering(tmp_path: Path) -> Iterator[tuple[int, list[str], list[str]]]:
    """An HTTPS "registry" for evil.test that steers its client elsewhere:
    every answer a redirect, and a token realm, to a loopback HTTP server
    that records whoever reaches it. Yields (its port, what it was asked,
    what reached the loopback server)."""
    reached: list[str] = []
    asked: list[str] = []

    class Victim(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            reached.append(self.path)
            self.send_response(200)
            self.end_headers()

        do_POST = do_GET

        def log_message(self, *args: Any) -> None:
            pass

    victim = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Victim)
    to = f"http://127.0.0.1:{victim.server_address[1]}"

    class Steer(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            if self.path == "/v2/":
                self.send_response(401)
                self.send_header("WWW-Authenticate", f'Bearer realm="{to}/token",service="x"')
            else:
                self.send_response(307)
                self.send_header("Location", f"{to}{self.path}")
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args: Any) -> None:
            pass

    steer = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Steer)
    port = steer.server_address[1]
    try:
        cert, key = trusted_cert(tmp_path, "evil.test", port)
        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(cert, key)
        steer.socket = tls.wrap_socket(steer.socket, server_side=True)
        for s in (victim, steer):
            threading.Thread(target=s.serve_forever, daemon=True).start()
        yield port, asked, reached
    finally:
        for s in (victim, steer):
            s.shutdown()
            s.server_close()
        shutil.rmtree(certs_dir("evil.test", port), ignore_errors=True)


async def test_a_registry_cannot_steer_a_guarded_pull_to_the_nodes_loopback(
    store: ImageStore, steering: tuple[int, list[str], list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registry names where skopeo goes next (a redirect, a token realm),
    and Go never sends a loopback address through a proxy: in the pull's own
    network namespace nothing but the guard answers, so the node's loopback
    services are out of reach whatever the registry says."""
    port, asked, reached = steering
    monkeypatch.setenv("CORRAL_REGISTRIES", f"evil.test:{port}")  # let through to its answers
    dns = lambda host, _: ["127.0.0.1"] if host == "evil.test" else []  # noqa: E731
    with PullGuard(resolve=dns) as guard, pytest.raises(corral.CorralError):
        await asyncio.to_thread(pull, store, f"evil.test:{port}/team/app:1", _quiet, guard=guard)
    assert asked and reached == [], (asked, reached)  # it was reached, and steered nowhere


async def test_a_guarded_node_refuses_a_create_from_its_own_network(
    node: Node, registry: Registry, store: ImageStore, tmp_path: Path
) -> None:
    """A cluster node's pulls are guarded (NodeConfig.pull_guard): a loopback
    registry, which Go would reach without any proxy, is refused by name,
    and the create names its field."""
    push(registry, tmp_path, "team/app:1", [*BASE, TOP], CONFIG)
    before = len(store.list())
    async with node.with_config(pull_guard=True).client() as c:
        with pytest.raises(corral.InvalidArgument, match="inside the cluster's network") as err:
            await c.sandboxes.create(image=f"{registry.host}/team/app:1")
        assert err.value.details["field"] == "image"
        assert await c.sandboxes.list() == []
    assert len(store.list()) == before


async def test_push_then_pull_round_trips_corral_and_pulled_images(
    node: Node, registry: Registry, store: ImageStore, tmp_path: Path
) -> None:
    from corral.images.build import build_from_dir
    from corral.images.layer import ImageConfig
    from corral.images.push import push as push_image

    tree = tmp_path / "tree"
    (tree / "srv").mkdir(parents=True)
    (tree / "srv" / "hello.txt").write_text("made in corral\n")
    os.chmod(tree / "srv" / "hello.txt", 0o4755)  # modes survive the trip
    made = build_from_dir(store, tree, tag="regtest-made:1",
                          config=ImageConfig(env=["MADE=1"], workdir="/srv"))  # fmt: skip
    try:
        await asyncio.to_thread(push_image, store, "regtest-made:1",
                                f"{registry.host}/corral/made:1", _quiet)  # fmt: skip
        back = await asyncio.to_thread(pull, store, f"{registry.host}/corral/made:1", _quiet)
        assert back.config.workdir == "/srv" and back.config.env == ["MADE=1"]
        # A pulled image goes out as it came (its manifest, byte for byte).
        push(registry, tmp_path, "team/app:1", [*BASE, TOP], CONFIG)
        pulled = await asyncio.to_thread(pull, store, f"{registry.host}/team/app:1", _quiet)
        await asyncio.to_thread(push_image, store, f"{registry.host}/team/app:1",
                                f"{registry.host}/mirror/app:1", _quiet)  # fmt: skip
        mirror = await asyncio.to_thread(pull, store, f"{registry.host}/mirror/app:1", _quiet)
        assert mirror.labels["oci.manifest"] == pulled.labels["oci.manifest"]
        assert [x.digest for x in store.chain(mirror)][:-1] == [
            x.digest for x in store.chain(pulled)][:-1]  # fmt: skip
        async with node.client() as c:
            sbx = await c.sandboxes.create(image=f"{registry.host}/corral/made:1")
            try:
                assert await sbx.files.read("/srv/hello.txt") == b"made in corral\n"
                assert (await sbx.files.stat("/srv/hello.txt")).mode & 0o7777 == 0o4755
                r = await sbx.commands.run("echo $MADE; pwd")  # the platform's bash: no image shell
                assert r.stdout == "1\n/srv\n", r
            finally:
                await sbx.close()
        with pytest.raises(corral.InvalidArgument) as err:
            push_image(store, "regtest-made:1", "/not/a/registry", _quiet)
        assert err.value.details["field"] == "dest"
    finally:
        store.untag("regtest-made:1")
        store.remove(made.digest)


async def test_a_stack_goes_through_a_blob_store_whole_and_lazily(
    registry: Registry, store: ImageStore, tmp_path: Path
) -> None:
    from corral.images import registry as blobs
    from corral.images.objects import open_store, operator_key

    push(registry, tmp_path, "team/app:1", [*BASE, TOP], CONFIG)
    top = await asyncio.to_thread(pull, store, f"{registry.host}/team/app:1", _quiet)
    remote = open_store(str(tmp_path / "blobstore"), operator_key())
    await asyncio.to_thread(blobs.push, store, f"{registry.host}/team/app:1", remote, _quiet)
    other = ImageStore(tmp_path / "other-node")
    got = await asyncio.to_thread(blobs.pull, other, f"{registry.host}/team/app:1", remote, _quiet)
    assert [x.digest for x in other.chain(got)] == [x.digest for x in store.chain(top)]
    # Lazily: the manifests are here, the data stays in the store until read.
    assert all(not other.has_blob(x.blob_digest) for x in other.chain(got) if x.blob_size)
    assert all(other.origin(x.digest) for x in other.chain(got) if x.blob_size)


async def test_platforms_media_types_and_compressions(
    registry: Registry, store: ImageStore, tmp_path: Path
) -> None:
    platforms = {"amd64": [{"arch.txt": b"amd64"}], "arm64": [{"arch.txt": b"arm64"}]}
    oci_image(tmp_path / "multi", BASE, {"Env": []}, platforms=platforms)
    registry.push(tmp_path / "multi", "team/multi:1", "--all")  # an image index, both kept
    oci_image(tmp_path / "plain", [*BASE, {"kind.txt": b"any"}], {"Env": []})
    registry.push(tmp_path / "plain", "team/docker:1", "--format", "v2s2")  # docker types
    registry.push(tmp_path / "plain", "team/zstd:1", "--dest-compress-format", "zstd")

    def tree(top: Any) -> dict[str, bytes]:
        from corral.host import mounts
        from corral.images.mounter import LayerMounts

        out: dict[str, bytes] = {}
        mnt = LayerMounts(store, tmp_path / "mnt")
        try:
            for layer in store.chain(top):
                root = mnt.ensure(layer)
                for p in root.rglob("*.txt"):
                    out[str(p.relative_to(root))] = p.read_bytes()
        finally:
            for point, _fs, _src in mounts.mounts_under(tmp_path / "mnt"):
                mounts.umount(point)
        return out

    amd = await asyncio.to_thread(pull, store, f"{registry.host}/team/multi:1", _quiet)
    assert tree(amd)["arch.txt"] == b"amd64"  # the platform asked for (linux/amd64)
    arm = await asyncio.to_thread(pull, store, f"{registry.host}/team/multi:1", _quiet,
                                  platform="linux/arm64")  # fmt: skip
    assert tree(arm)["arch.txt"] == b"arm64"
    for name in ("docker", "zstd"):
        got = await asyncio.to_thread(pull, store, f"{registry.host}/team/{name}:1", _quiet)
        assert tree(got)["kind.txt"] == b"any" and tree(got)["etc/b.txt"] == b"b\n", name


async def test_credentials_from_a_docker_login_style_file(
    store: ImageStore, tmp_path: Path
) -> None:
    reg = Registry(tmp_path / "locked", auth=True)
    reg.start()
    try:
        push(reg, tmp_path, "team/private:1", [*BASE, {"p.txt": b"private"}], {"Env": []})
        ref = f"{reg.host}/team/private:1"
        with pytest.raises(corral.Unauthenticated):
            pull(store, ref, _quiet)  # no credentials
        with pytest.raises(corral.Unauthenticated):
            pull(store, ref, _quiet, authfile=reg.authfile("wrong"))
        top = await asyncio.to_thread(pull, store, ref, _quiet, authfile=reg.authfile())
        assert len(store.chain(top)) == 3
    finally:
        reg.stop()


async def test_a_dockerfile_builds_from_a_registry_image(
    node: Node, registry: Registry, store: ImageStore, tmp_path: Path
) -> None:
    from corral.build.builder import Builder, Options

    push(registry, tmp_path, "team/app:1", [*BASE, TOP], CONFIG)
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    (ctx / "added.txt").write_text("from the context\n")
    dockerfile = f"FROM {registry.host}/team/app:1\nWORKDIR /work\nCOPY added.txt .\n"
    async with node.client() as c:  # the node pulls the base on the build's first create
        result = await Builder(c, ctx, Options("regtest-built:1")).build(dockerfile)
        sbx = await c.sandboxes.create(image="regtest-built:1")
        try:
            assert await sbx.files.read("/work/added.txt") == b"from the context\n"
            assert await sbx.files.read("/etc/b.txt") == b"b\n"  # the pulled base under it
            assert not await sbx.files.exists("/etc/a.txt")
            r = await sbx.commands.run("echo $HELLO; pwd")
            assert r.stdout == "from-the-image\n/work\n", r
        finally:
            await sbx.close()
    assert len(result.steps) == 1


async def test_a_registry_that_accepts_and_never_answers_fails_the_pull_in_bounded_time(
    store: ImageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It would hold the node's layout lock, and every other pull, for ever.
    The lock is free again once the pull has failed."""
    monkeypatch.setattr(pull_module, "PULL_TIMEOUT", 3.0)
    held: list[socket.socket] = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        host = f"127.0.0.1:{server.getsockname()[1]}"
        stop = threading.Event()

        def accept() -> None:  # takes each connection and says nothing
            server.settimeout(0.2)
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    held.append(server.accept()[0])

        acceptor = threading.Thread(target=accept)
        acceptor.start()
        try:
            began = time.monotonic()
            with pytest.raises(corral.Unavailable, match="did not deliver the image within 3 s"):
                await asyncio.to_thread(pull, store, f"{host}/team/app:1", _quiet)
            assert time.monotonic() - began < 30
            assert held, "skopeo never reached the silent registry"
        finally:
            stop.set()
            acceptor.join()
            for conn in held:
                conn.close()
    with pull_module.locked_layout(store.root / "oci"):
        pass  # not held by the failed pull
