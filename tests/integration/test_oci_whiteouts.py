"""OCI layer tarballs applied in a chroot (images/oci.py apply_layers):
a whiteout or dotfile at the root of a layer is read by its name. Before,
"./.wh.build" lost its leading dot as a set of characters and became a
file "wh.build": a directory a later layer deleted (a RUN rm -rf /secrets)
showed through from the layer under it."""

from __future__ import annotations

import os
from pathlib import Path

from corral.images.oci import apply_layers

from ..framework.registry import layer_tar


def _tar(path: Path, entries: dict[str, bytes | None]) -> Path:
    path.write_bytes(layer_tar(entries))
    return path


def _noprogress(task: str, done: float, total: float | None) -> None:
    pass


def test_a_root_level_whiteout_deletes_what_the_layer_below_had(tmp_path: Path) -> None:
    lower = _tar(tmp_path / "1.tar", {
        "./secrets/": None, "./secrets/key": b"k", "./.profile": b"p", "./etc/": None,
        "./etc/.wh.keep": b"",
    })  # fmt: skip
    upper = _tar(
        tmp_path / "2.tar", {"./.wh.secrets": b"", "./.wh..profile": b"", "./.bashrc": b"b"}
    )
    root = tmp_path / "root"
    root.mkdir()
    apply_layers(root, [lower, upper], _noprogress, "t")
    assert not (root / "secrets").exists()
    assert not (root / ".profile").exists()
    assert (root / ".bashrc").read_bytes() == b"b"
    # Nothing under a name that lost its dot.
    assert sorted(os.listdir(root)) == [".bashrc", "etc"]
