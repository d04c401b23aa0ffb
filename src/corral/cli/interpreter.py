"""Builds E2B's code-interpreter template (images/interpreter.py): its
Debian layer in a sandbox (build/scripted.py), then its Python and Deno
layer.

    python -m corral.cli.interpreter    (the install script runs it)
"""

from __future__ import annotations

from pathlib import Path

from corral.build.scripted import ScriptedToolkit, ensure
from corral.images import interpreter
from corral.images.layer import Layer
from corral.images.store import ImageStore, ProgressFn

LANGS = ScriptedToolkit(
    tag=interpreter.LANGS_TAG,
    base="debian-python:bookworm",
    # Over E2B's user: a package that adds a system user writes /etc/passwd,
    # and the layer's copy must keep `user`.
    toolkit=("e2b-user:bookworm",),
    files=interpreter.LANGS_FILES,
    home=interpreter.LANGS_HOME,
    script="build.sh",
    args=tuple(interpreter.LANGS_DEBIAN),
    key=interpreter.langs_key(),
    label="interpreter.source",
    steps=4,
    ecosystems=("debian",),
)


def build(store: ImageStore, data_dir: Path, progress: ProgressFn) -> list[Layer]:
    """Both layers: each found again by its key, or built."""
    langs = ensure(LANGS, store, data_dir, progress)
    main = interpreter.build(store, data_dir / "cache" / "npm", progress)
    return [langs, main]


if __name__ == "__main__":
    from corral.config import NodeConfig
    from corral.progress import progress_bar

    cfg = NodeConfig.from_env()
    with progress_bar() as bar:
        layers = build(ImageStore(cfg.images_dir), cfg.data_dir, bar)
    for layer in layers:
        print(f"{layer.names[0] if layer.names else ''} {layer.digest} "
              f"({layer.content_size / 2**20:.1f} MiB)")  # fmt: skip
