"""Builds the function calls' toolchains (images/toolchains.py): the
toolchains layer in a sandbox (build/scripted.py), and the runners' layer.

    python -m corral.cli.toolchains    (the install script runs it)
"""

from __future__ import annotations

from pathlib import Path

from corral.build.scripted import ScriptedToolkit, ensure
from corral.images.layer import Layer
from corral.images.store import ImageStore, ProgressFn
from corral.images.toolchains import (
    BASE,
    DEBIAN,
    ECOSYSTEMS,
    FILES,
    HOME,
    LABEL,
    RUNNERS_TAG,
    TAG,
    build_runners,
    key,
)

SPEC = ScriptedToolkit(
    tag=TAG,
    base=BASE,
    files=FILES,
    home=HOME,
    script="build.sh",
    args=tuple(DEBIAN),
    key=key(),
    label=LABEL,
    steps=5,
    ecosystems=ECOSYSTEMS,
)


def build(store: ImageStore, data_dir: Path, progress: ProgressFn) -> Layer:
    """The toolchains' layer: found again by its key, or built."""
    return ensure(SPEC, store, data_dir, progress)


if __name__ == "__main__":
    from corral.config import NodeConfig
    from corral.progress import progress_bar

    cfg = NodeConfig.from_env()
    with progress_bar() as bar:
        store = ImageStore(cfg.images_dir)
        built = [build(store, cfg.data_dir, bar), build_runners(store, bar)]
    for tag, layer in zip((TAG, RUNNERS_TAG), built, strict=True):
        print(f"{tag} {layer.digest} ({layer.content_size / 2**20:.1f} MiB)")
