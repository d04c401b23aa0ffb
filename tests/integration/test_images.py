"""Layers end to end: OCI/docker import, commit of a sandbox's changes,
push to an HTTP store and lazy pull on another node."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import corral
from corral.config import NodeConfig
from corral.images import registry
from corral.images.objects import HttpObjects, open_store
from corral.images.oci import import_oci
from corral.images.store import ImageStore

from ..framework import IMAGE, Blobd, Node, oci_layout


def _noprogress(task: str, done: float, total: float | None) -> None:
    pass


def _entry(
    tar: tarfile.TarFile,
    name: str,
    data: bytes | None = None,
    *,
    kind: bytes = tarfile.REGTYPE,
    link: str = "",
    mode: int = 0o644,
) -> None:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.linkname = link
    if data is not None:
        info.size = len(data)
    tar.addfile(info, io.BytesIO(data) if data is not None else None)


def _layer_tar(build: Callable[[tarfile.TarFile], None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        build(tar)
    return buf.getvalue()


def _busybox_layer(tar: tarfile.TarFile) -> None:
    _entry(tar, "bin", kind=tarfile.DIRTYPE, mode=0o755)
    _entry(tar, "bin/busybox", Path("/bin/busybox").read_bytes(), mode=0o755)
    for app in ("sh", "cat", "ls", "readlink", "id"):
        _entry(tar, f"bin/{app}", kind=tarfile.SYMTYPE, link="busybox")
    _entry(tar, "etc", kind=tarfile.DIRTYPE, mode=0o755)
    _entry(
        tar, "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n"
    )
    _entry(tar, "data", kind=tarfile.DIRTYPE, mode=0o755)
    _entry(tar, "data/keep", b"from layer 1\n")
    _entry(tar, "data/gone", b"deleted by layer 2\n")
    _entry(tar, "opaque", kind=tarfile.DIRTYPE, mode=0o755)
    _entry(tar, "opaque/old", b"hidden by layer 2\n")
    # An absolute symlink a later layer will try to write through.
    _entry(tar, "escape", kind=tarfile.SYMTYPE, link="/tmp/corral-oci-escape")


def _second_layer(tar: tarfile.TarFile) -> None:
    _entry(tar, "data/.wh.gone", b"")
    _entry(tar, "opaque/.wh..wh..opq", b"")
    _entry(tar, "opaque/new", b"layer 2\n")
    _entry(tar, "escape", b"must land inside the image\n")
    _entry(tar, "home/app/hello", b"hello\n")


def _oci_layout(root: Path) -> Path:
    return oci_layout(
        root,
        [_layer_tar(_busybox_layer), _layer_tar(_second_layer)],
        {"Env": ["PATH=/bin", "GREETING=oci"], "WorkingDir": "/home/app", "User": "app"},
    )


async def _check_oci_image(client: corral.AsyncClient, ref: str) -> None:
    sbx = await client.sandboxes.create(image=ref)
    r = await sbx.commands.run(
        "cat /data/keep; ls /data; ls /opaque; cat /escape; pwd; echo $GREETING; id -u"
    )
    assert r.stdout.split("\n") == [
        "from layer 1",
        "keep",
        "new",
        "must land inside the image",
        "/home/app",
        "oci",
        "1000",
        "",
    ], r.stderr
    await sbx.close()
    assert not Path("/tmp/corral-oci-escape").exists()


async def test_import_an_oci_layout_archive(
    embedded: corral.AsyncClient, tmp_path: Path, node_config: NodeConfig
) -> None:
    layout = _oci_layout(tmp_path / "oci")
    archive = tmp_path / "image.oci.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(layout, arcname=".")
    store = ImageStore(node_config.images_dir)
    layer = import_oci(store, archive, tag="oci-test:1", progress=_noprogress)
    assert layer.config.workdir == "/home/app" and layer.config.user == "app"
    await _check_oci_image(embedded, "oci-test:1")
    store.untag("oci-test:1")


async def test_import_a_docker_save_tarball(
    embedded: corral.AsyncClient, tmp_path: Path, node_config: NodeConfig
) -> None:
    root = tmp_path / "docker"
    (root / "l1").mkdir(parents=True)
    (root / "l2").mkdir()
    (root / "l1" / "layer.tar").write_bytes(_layer_tar(_busybox_layer))
    (root / "l2" / "layer.tar").write_bytes(_layer_tar(_second_layer))
    (root / "config.json").write_text(
        json.dumps(
            {
                "config": {
                    "Env": ["PATH=/bin", "GREETING=oci"],
                    "WorkingDir": "/home/app",
                    "User": "1000",
                }
            }
        )
    )
    (root / "manifest.json").write_text(
        json.dumps(
            [
                {
                    "Config": "config.json",
                    "RepoTags": ["x:1"],
                    "Layers": ["l1/layer.tar", "l2/layer.tar"],
                }
            ]
        )
    )
    archive = tmp_path / "saved.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(root, arcname=".")
    store = ImageStore(node_config.images_dir)
    import_oci(store, archive, tag="docker-test:1", progress=_noprogress)
    await _check_oci_image(embedded, "docker-test:1")
    store.untag("docker-test:1")


async def test_commit_a_sandbox_into_a_toolkit(client: corral.AsyncClient) -> None:
    sbx = await client.sandboxes.create(image=IMAGE)
    await sbx.commands.run(
        "mkdir -p /opt/tool && echo 'print(\"tool v1\")' > /opt/tool/run.py && "
        "chown 1000:1000 /opt/tool/run.py && "
        "rm /etc/debian_version && echo changed > /etc/hostname"
    )
    layer = await sbx.commit("committed-tool:1", kind="toolkit")
    assert layer.kind == "toolkit" and layer.names == ["committed-tool:1"]
    assert layer.parent == sbx.info.layers[-1]
    assert (await sbx.commands.run("echo still running")).stdout == "still running\n"
    await sbx.close()
    other = await client.sandboxes.create(image=IMAGE, toolkit="committed-tool:1")
    r = await other.commands.run(
        "python3 /opt/tool/run.py; cat /etc/hostname; test -e /etc/debian_version || echo deleted;"
        "stat -c %u /opt/tool /opt/tool/run.py"
    )
    # Owners come back as the sandbox saw them, not as the host stored them.
    assert r.stdout.split() == ["tool", "v1", "changed", "deleted", "0", "1000"]
    await other.close()


async def test_lazy_pull_from_an_http_store(
    node_config: NodeConfig, data_root: Path, blobd: Blobd
) -> None:
    # Node A's layers go to the shared store; node B pulls them and starts
    # a sandbox that fetches only what it reads.
    source = ImageStore(node_config.images_dir)
    shared = HttpObjects(blobd.url)
    registry.push(source, IMAGE, shared, _noprogress)
    images_b = data_root / "images-b"
    b = Node(replace(node_config, data_dir=data_root / "nodeb", node="b", images=images_b))
    registry.pull(ImageStore(images_b), IMAGE, open_store(blobd.url), _noprogress)
    async with b.client() as client:
        sbx = await client.sandboxes.create(image=IMAGE)
        r = await sbx.commands.run("python3 -c 'import json; print(json.dumps([1]))'")
        assert r.stdout == "[1]\n"
        stats = json.loads((b.config.data_dir / "lazy" / "fs" / ".stats").read_bytes())
        layer = stats["layers"][source.resolve(IMAGE).digest]
        assert 0 < layer["fetched_bytes"] < 0.25 * layer["blob_size"], layer
        await sbx.close()
    assert not (b.config.data_dir / "lazy" / "fs" / ".stats").exists()  # the loader stopped
    assert b.leftovers() == {}
