"""Builds the layers of Corral's E2B templates (config.py
DEFAULT_E2B_TEMPLATES) that come from packages: E2B's base template's tools
(images/e2b_tools.py) and the code interpreter's R and Java, each in a
sandbox (build/scripted.py), then the code interpreter's Python and Deno
layer (images/interpreter.py). e2b-user, which they are built over, comes
first (the install script builds it).

    python -m corral.cli.e2b_templates    (the install script runs it)
"""

from __future__ import annotations

from pathlib import Path

from corral.build.scripted import ScriptedToolkit, ensure
from corral.images import e2b_tools, interpreter
from corral.images.layer import Layer
from corral.images.store import ImageStore, ProgressFn

BASE = "debian-python:bookworm"
USER = "e2b-user:bookworm"
LABEL = "e2b.source"

TOOLS = ScriptedToolkit(
    tag=e2b_tools.TAG,
    base=BASE,
    # Over E2B's user: a package that adds a system user writes /etc/passwd,
    # and the layer's copy must keep `user`.
    toolkit=(USER,),
    files=e2b_tools.FILES,
    home=e2b_tools.HOME,
    script="build.sh",
    args=tuple(e2b_tools.DEBIAN),
    key=e2b_tools.key(),
    label=LABEL,
    steps=3,
    ecosystems=("debian",),
)

LANGS = ScriptedToolkit(
    tag=interpreter.LANGS_TAG,
    base=BASE,
    toolkit=(USER, e2b_tools.TAG),
    files=interpreter.LANGS_FILES,
    home=interpreter.LANGS_HOME,
    script="build.sh",
    args=tuple(interpreter.LANGS_DEBIAN),
    key=interpreter.langs_key(),
    label=LABEL,
    steps=4,
    ecosystems=("debian",),
)


def build(store: ImageStore, data_dir: Path, progress: ProgressFn) -> list[Layer]:
    """Every layer: each found again by its key, or built, in order."""
    tools = ensure(TOOLS, store, data_dir, progress)
    langs = ensure(LANGS, store, data_dir, progress)
    main = interpreter.build(store, data_dir / "cache" / "npm", progress)
    return [tools, langs, main]


if __name__ == "__main__":
    from corral.config import NodeConfig
    from corral.progress import progress_bar

    cfg = NodeConfig.from_env()
    with progress_bar() as bar:
        layers = build(ImageStore(cfg.images_dir), cfg.data_dir, bar)
    for layer in layers:
        print(f"{layer.names[0] if layer.names else ''} {layer.digest} "
              f"({layer.content_size / 2**20:.1f} MiB)")  # fmt: skip
