from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from corral.config import NodeConfig
from corral.errors import ImageNotFound, InvalidArgument
from corral.host.mounts import _unescape
from corral.host.platform import is_static_elf
from corral.images.layer import IDENTITY, ImageConfig, Ref
from corral.images.store import ImageStore


@pytest.mark.parametrize(
    ("text", "name", "tag"),
    [
        ("debian:12", "debian", "12"),
        ("debian", "debian", "latest"),
        ("a/b-c.d:v1.2_3", "a/b-c.d", "v1.2_3"),
    ],
)
def test_refs(text: str, name: str, tag: str) -> None:
    ref = Ref.parse(text)
    assert (ref.name, ref.tag, ref.digest) == (name, tag, None)


def test_digest_ref() -> None:
    d = "sha256:" + "ab" * 32
    assert Ref.parse(d).digest == d


@pytest.mark.parametrize("bad", ["", "UP:1", "a:", "a:b:c", "../x", "sha256:short", "a b"])
def test_bad_refs(bad: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        Ref.parse(bad, "workspace")
    assert exc.value.field == "workspace"


def test_a_layers_digest_covers_its_content_not_its_names_or_time(tmp_path: Path) -> None:
    (tmp_path / "m").write_bytes(b"m" * 100)
    (tmp_path / "b").write_bytes(b"b" * 150_000)
    layer = ImageStore(tmp_path / "s").add(tmp_path / "m", tmp_path / "b", chunk_size=65536)
    assert layer.identity == IDENTITY and layer.expected_digest() == layer.digest
    same = replace(layer, names=["x:1"], created=0.0)
    assert same.expected_digest() == layer.digest
    for change in ({"config": ImageConfig(workdir="/w")}, {"labels": {"a": "b"}},
                   {"kind": "base"}, {"parent": "sha256:" + "1" * 64}, {"content_size": 7},
                   {"chunk_digests": ["0" * 64] * 3}, {"meta_size": 99}):  # fmt: skip
        assert replace(layer, **change).expected_digest() != layer.digest, change


def test_store_add_tag_resolve_untag_gc(tmp_path: Path) -> None:
    store = ImageStore(tmp_path)
    meta, blob = tmp_path / "meta", tmp_path / "blob"
    meta.write_bytes(b"m" * 100)
    blob.write_bytes(b"b" * 150_000)
    layer = store.add(meta, blob, chunk_size=65536, kind="toolkit", tag="tk:1")
    assert len(layer.chunk_digests) == 3
    assert store.resolve("tk:1").digest == layer.digest
    assert store.resolve(layer.digest).names == ["tk:1"]
    store.tag(layer.digest, "tk:latest")
    assert store.resolve("tk").digest == layer.digest
    store.untag("tk:1")
    store.untag("tk:latest")
    with pytest.raises(ImageNotFound) as exc:
        store.resolve("tk:1")
    assert "corral image ls" in exc.value.message
    assert store.gc(in_use={layer.digest})[0] == 0  # a running sandbox keeps it
    removed, freed = store.gc(in_use=set())
    assert removed == 1 and freed == 150_100
    assert list(store.blobs.iterdir()) == []


def test_an_untag_leaves_no_empty_name_folders(tmp_path: Path) -> None:
    """Every walk of the tags steps through each folder: a pull's
    host_port/repo folders, left empty by untags, made the walk of this
    machine's store 30 ms. An untag prunes them; gc prunes those left
    before; a tag after a prune makes its folders again."""
    store = ImageStore(tmp_path)
    (tmp_path / "m").write_bytes(b"m")
    (tmp_path / "b").write_bytes(b"b")
    layer = store.add(tmp_path / "m", tmp_path / "b", chunk_size=4096, kind="toolkit",
                      tag="127.0.0.1_5000/team/app:1")  # fmt: skip
    store.tag(layer.digest, "127.0.0.1_5000/team/other:1")
    store.untag("127.0.0.1_5000/team/app:1")
    assert sorted(p.name for p in (store.tags / "127.0.0.1_5000" / "team").iterdir()) == ["other"]
    store.untag("127.0.0.1_5000/team/other:1")
    assert list(store.tags.iterdir()) == []
    (store.tags / "old" / "left" / "empty").mkdir(parents=True)  # from before the prune
    store.tag(layer.digest, "old/kept:1")
    store.gc(in_use={layer.digest})
    assert [str(p.relative_to(store.tags)) for p in sorted(store.tags.rglob("*"))] == [
        "old", "old/kept", "old/kept/1"]  # fmt: skip
    assert store.resolve("old/kept:1").digest == layer.digest


def test_unknown_layer_kind_is_refused(tmp_path: Path) -> None:
    store = ImageStore(tmp_path)
    (tmp_path / "m").write_bytes(b"m")
    (tmp_path / "b").write_bytes(b"b")
    with pytest.raises(InvalidArgument):
        store.add(tmp_path / "m", tmp_path / "b", chunk_size=4096, kind="weird")


def test_config_from_env_and_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CORRAL_NODE", "n7")
    monkeypatch.setenv("CORRAL_SCRATCH_SIZE", "8GiB")
    cfg = NodeConfig.from_env(data_dir="/tmp/x")
    assert cfg.node == "n7" and cfg.scratch_size == 8 * 2**30
    assert cfg.data_dir == Path("/tmp/x") and cfg.images_dir == Path("/tmp/x/images")
    with pytest.raises(InvalidArgument) as exc:
        NodeConfig(node="Bad-Name")
    assert exc.value.field == "node"
    with pytest.raises(InvalidArgument) as exc:
        NodeConfig(data_dir=Path("/" + "d" * 80))
    assert exc.value.field == "data_dir"
    monkeypatch.setenv("CORRAL_READY_TIMEOUT", "120")
    assert NodeConfig.from_env(data_dir="/tmp/x").ready_timeout == 120.0
    for bad in (0.0, -1.0, 601.0):
        with pytest.raises(InvalidArgument, match="from 1 to 600") as exc:
            NodeConfig(ready_timeout=bad)
        assert (exc.value.field, exc.value.value) == ("ready_timeout", bad)


def test_mountinfo_unescaping() -> None:
    assert _unescape(r"/a\040b\011c\134d") == "/a b\tc\\d"


def test_static_elf_detection() -> None:
    assert is_static_elf(Path("/bin/busybox")) or not Path("/bin/busybox").exists()
    assert not is_static_elf(Path("/bin/ls"))
