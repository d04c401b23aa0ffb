"""What a layer may carry onto a host (issue 14, class 2): device nodes in
a source tree are left out of the layer (the source is not changed),
overlay whiteouts stay, setuid bits are kept as given, and the host-side
mount of every layer is nosuid and nodev."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest

from corral.errors import Unavailable
from corral.host import mounts
from corral.images.build import build_from_dir, device_nodes
from corral.images.mounter import LayerMounts
from corral.images.store import ImageStore


def _mount(store: ImageStore, digest: str, at: Path) -> None:
    """As the node mounts a layer (images/mounter.py), without the loader."""
    layer = store.get(digest)
    at.mkdir()
    opts = f"device={store.blob_path(layer.blob_digest)}" if layer.blob_size else None
    flags = mounts.MS_RDONLY | mounts.MS_NOSUID | mounts.MS_NODEV
    mounts.mount(str(store.blob_path(layer.meta_digest)), str(at), "erofs", flags, opts)


def test_devices_are_left_out_and_whiteouts_and_setuid_bits_kept(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "dev").mkdir(parents=True)
    (src / "etc").mkdir()
    os.mknod(src / "dev" / "mem2", 0o600 | stat.S_IFCHR, os.makedev(1, 1))  # /dev/mem
    os.mknod(src / "dev" / "sda2", 0o600 | stat.S_IFBLK, os.makedev(8, 0))
    os.mknod(src / "etc" / "gone", 0o600 | stat.S_IFCHR, os.makedev(0, 0))  # a whiteout
    (src / "etc" / "suid").write_text("#!/bin/sh\n")
    os.chmod(src / "etc" / "suid", 0o4755)
    assert device_nodes(src) == ["dev/mem2", "dev/sda2"]
    store = ImageStore(tmp_path / "images")
    layer = build_from_dir(store, src, tag="hygiene:1", kind="layer")
    assert (src / "dev" / "mem2").exists()  # the source is left as it was
    mnt = tmp_path / "mnt"
    _mount(store, layer.digest, mnt)
    try:
        assert sorted(os.listdir(mnt / "dev")) == []
        st = os.lstat(mnt / "etc" / "gone")
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
        assert os.stat(mnt / "etc" / "suid").st_mode & 0o7777 == 0o4755
    finally:
        mounts.umount(str(mnt))


def test_a_metadata_image_that_fails_its_digest_is_never_mounted(tmp_path: Path) -> None:
    """Class 8: the host kernel parses a layer's metadata image, so one
    fetched from a store is checked against the (verified) manifest first."""
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "f").write_text("x" * 100_000)
    built = ImageStore(tmp_path / "built")
    layer = build_from_dir(built, src, tag="meta:1", kind="layer")
    # A node that has the manifest but not the metadata image, whose
    # origin serves a different (valid EROFS) image under its name.
    (tmp_path / "src2").mkdir()
    (tmp_path / "src2" / "g").write_text("other")
    other = build_from_dir(built, tmp_path / "src2", tag="other:1", kind="layer")
    origin = tmp_path / "origin"
    (origin / "blobs" / "sha256").mkdir(parents=True)
    shutil.copy(
        built.blob_path(other.meta_digest),
        origin / "blobs" / "sha256" / layer.meta_digest.removeprefix("sha256:"),
    )
    node = ImageStore(tmp_path / "node")
    node.put_manifest(layer)
    node.set_origin(layer.digest, str(origin))
    shutil.copy(built.blob_path(layer.blob_digest), node.blob_path(layer.blob_digest))
    layers = LayerMounts(node, tmp_path / "m")
    with pytest.raises(Unavailable, match="does not match its digest"):
        layers.ensure(node.get(layer.digest))
    assert mounts.mounts_under(tmp_path) == []
    assert not node.has_blob(layer.meta_digest)


def test_a_layer_another_agent_released_is_mounted_again(tmp_path: Path) -> None:
    """Two agents of one node share its layer mounts: one agent's garbage
    collection may unmount (and remove) a layer the other mounted earlier,
    and the other's next create must find it mounted again, not a path
    that is gone (seen in CI: crun's open_tree of the layer, ENOENT)."""
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc" / "f").write_text("layer")
    store = ImageStore(tmp_path / "images")
    layer = store.get(build_from_dir(store, src, tag="shared:1", kind="layer").digest)
    creating, leader = LayerMounts(store, tmp_path / "m"), LayerMounts(store, tmp_path / "m")
    try:
        path = creating.ensure(layer)
        assert (path / "etc" / "f").read_text() == "layer"
        # The leader keeps what an active sandbox references, read under
        # the lock, and releases the rest.
        assert leader.release_unused(lambda: [layer.digest]) == []
        assert leader.release_unused(lambda: []) == [path.name]
        assert not path.exists()
        assert creating.ensure(layer) == path
        assert (path / "etc" / "f").read_text() == "layer"
    finally:
        leader.release_unused(lambda: [])
    assert mounts.mounts_under(tmp_path) == []


def test_a_sandboxs_layers_are_mounted_together_in_their_order(tmp_path: Path) -> None:
    """A create takes all its layers under one hold of the lock
    (ensure_all): each is mounted, a mounted one is left as it is, and the
    paths come back in the order asked."""
    store = ImageStore(tmp_path / "images")
    made = []
    for name in ("base", "workspace", "toolkit"):
        src = tmp_path / name
        (src / "etc").mkdir(parents=True)
        (src / "etc" / name).write_text(name)
        made.append(store.get(build_from_dir(store, src, tag=f"{name}:1", kind="layer").digest))
    layers = LayerMounts(store, tmp_path / "m")
    try:
        first = layers.ensure(made[1])
        paths = layers.ensure_all(made)
        assert paths == [layers.path(layer.digest) for layer in made]
        assert paths[1] == first
        for path, name in zip(paths, ("base", "workspace", "toolkit"), strict=True):
            assert (path / "etc" / name).read_text() == name
        assert len(mounts.mounts_under(tmp_path / "m")) == 3
    finally:
        layers.release_unused(lambda: [])
    assert mounts.mounts_under(tmp_path) == []
