"""The Python packages that code problems import, as a toolkit layer over
the function image (fncall:bookworm): what SandboxFusion's python runtime
gives its calls, less the GPU and service stacks (torch, tensorflow,
database and queue clients), which no judged snippet can use here.

Pinned; built once, found again by its label. `python -m
corral.images.fncall_python` builds it (the install script does).
"""

from __future__ import annotations

from pathlib import Path

from corral.images import pypi
from corral.images.build import build_cached
from corral.images.layer import Layer
from corral.images.store import ImageStore, ProgressFn

TAG = "fncall-python:bookworm"
HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
PACKAGES = [
    "requests==2.32.3",
    "numpy==1.26.4",
    "pandas==2.2.3",
    "scipy==1.13.1",
    "sympy==1.13.3",
    "networkx==3.3",
    "matplotlib==3.9.2",
    "scikit-learn==1.5.2",
    "pytest==8.3.3",
    "beautifulsoup4==4.12.3",
    "lxml==5.3.0",
    "pillow==10.4.0",
    "openpyxl==3.1.5",
    "sortedcontainers==2.4.0",
    "toml==0.10.2",
    "PyJWT==2.9.0",
    "Flask==3.0.3",
    "psutil==6.0.0",
    # /run_jupyter's kernels (SandboxFusion's python3 kernel).
    "ipykernel==6.29.5",
    "jupyter_client==8.6.3",
    "ipython==8.29.0",
]


def build(store: ImageStore, progress: ProgressFn) -> Layer:
    def fill(stage: Path) -> None:
        pypi.install(stage, PACKAGES, "the function calls' Python packages", progress)
        pypi.launcher(stage, "pytest", "pytest:console_main")
        # debootstrap's root has no /etc/hosts: without it "localhost" does
        # not resolve, and a call's own server on localhost is unreachable.
        (stage / "etc").mkdir()
        (stage / "etc/hosts").write_text(HOSTS)

    key = "pip:" + ",".join(PACKAGES) + ":hosts"
    return build_cached(store, TAG, key, fill, progress=progress)


if __name__ == "__main__":
    from corral.config import NodeConfig
    from corral.progress import progress_bar

    cfg = NodeConfig.from_env()
    with progress_bar() as bar:
        built = build(ImageStore(cfg.images_dir), bar)
    print(f"{TAG} {built.digest} ({built.content_size / 2**20:.1f} MiB)")
