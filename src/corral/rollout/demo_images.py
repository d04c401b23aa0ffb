"""The layers of the main job: a Debian base, a pytest toolkit, and one
workspace per real project (its PyPI sdist, tests included).

Each is built once and found again by its label (versions and hashes are
pinned), so a second `make demo` builds nothing.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from corral.errors import Unavailable
from corral.images.build import build_debootstrap, build_from_dir
from corral.images.layer import ImageConfig, Layer
from corral.images.store import ImageStore, ProgressFn

BASE = "debian-python:bookworm"
TOOLKIT = "pytest:8.3.3"
PYTEST = ["pytest==8.3.3", "pluggy==1.5.0", "iniconfig==2.0.0", "packaging==24.1"]
SITE = "usr/local/lib/python3.11/dist-packages"


@dataclass(frozen=True)
class Project:
    name: str
    version: str
    sha256: str
    url: str
    tests: str  # what pytest runs, relative to /workspace

    @property
    def ref(self) -> str:
        return f"ws-{self.name}:{self.version}"

    @property
    def test_command(self) -> str:
        return f"python3 -m pytest -q -p no:cacheprovider {self.tests}"


_FILES = "https://files.pythonhosted.org/packages"
PROJECTS = [
    Project(
        "six",
        "1.16.0",
        "1e61c37477a1626458e36f7b1d82aa5c9b094fa4802892072e49de9c60c4c926",
        f"{_FILES}/71/39/171f1c67cd00715f190ba0b100d606d440a28c93c7714febeca8b79af85e/"
        "six-1.16.0.tar.gz",
        "test_six.py",
    ),
    Project(
        "more-itertools",
        "10.5.0",
        "5482bfef7849c25dc3c6dd53a6173ae4795da2a41a80faea6700d9f5846c5da6",
        f"{_FILES}/51/78/65922308c4248e0eb08ebcbe67c95d48615cc6f27854b6f2e57143e9178f/"
        "more-itertools-10.5.0.tar.gz",
        "tests",
    ),
    Project(
        "toolz",
        "1.0.0",
        "2c86e3d9a04798ac556793bced838816296a2f085017664e4995cb40a1047a02",
        f"{_FILES}/8a/0b/d80dfa675bf592f636d1ea0b835eab4ec8df6e9415d8cfd766df54456123/"
        "toolz-1.0.0.tar.gz",
        "toolz/tests",
    ),
]


def _cached(store: ImageStore, key: str, tag: str) -> Layer | None:
    layer = store.find_by_label("corral.source", key)
    if layer is not None:
        store.tag(layer.digest, tag)
    return layer


def base(store: ImageStore, progress: ProgressFn) -> Layer:
    return build_debootstrap(store, "bookworm", ["python3"], tag=BASE, progress=progress)


def toolkit(store: ImageStore, progress: ProgressFn) -> Layer:
    key = "pip:" + ",".join(PYTEST)
    if layer := _cached(store, key, TOOLKIT):
        return layer
    stage = store.tmpdir("toolkit")
    progress("pip install pytest", 0, 1)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-compile",
            "--no-deps",
            "--only-binary=:all:",
            "--target",
            str(stage / SITE),
            *PYTEST,
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise Unavailable(f"installing the pytest toolkit failed: {proc.stderr[-1000:]}")
    bin_dir = stage / "usr/local/bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "pytest").write_text(
        "#!/usr/bin/python3\nimport sys\nimport pytest\nsys.exit(pytest.console_main())\n"
    )
    (bin_dir / "pytest").chmod(0o755)
    progress("pip install pytest", 1, 1)
    try:
        return build_from_dir(
            store,
            stage,
            tag=TOOLKIT,
            kind="toolkit",
            labels={"corral.source": key},
            progress=progress,
        )
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _download(url: str, sha256: str, dest: Path) -> Path:
    if dest.exists() and hashlib.sha256(dest.read_bytes()).hexdigest() == sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    resp = httpx.get(url, follow_redirects=True, timeout=120)
    resp.raise_for_status()
    if hashlib.sha256(resp.content).hexdigest() != sha256:
        raise Unavailable(f"{url}: sha256 mismatch, refusing it")
    dest.write_bytes(resp.content)
    return dest


def workspace(store: ImageStore, project: Project, cache: Path, progress: ProgressFn) -> Layer:
    key = f"sdist:{project.name}=={project.version}:{project.sha256[:16]}"
    if layer := _cached(store, key, project.ref):
        return layer
    progress(f"download {project.name}", 0, 1)
    sdist = _download(project.url, project.sha256, cache / Path(project.url).name)
    progress(f"download {project.name}", 1, 1)
    stage = store.tmpdir("workspace")
    try:
        with tarfile.open(sdist) as tar:
            tar.extractall(stage, filter="data")
        (top,) = list(stage.iterdir())
        top.rename(stage / "workspace")
        return build_from_dir(
            store,
            stage,
            tag=project.ref,
            kind="workspace",
            config=ImageConfig(workdir="/workspace"),
            labels={"corral.source": key},
            progress=progress,
        )
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def ensure_all(store: ImageStore, cache: Path, progress: ProgressFn) -> None:
    base(store, progress)
    toolkit(store, progress)
    for project in PROJECTS:
        workspace(store, project, cache, progress)


if __name__ == "__main__":
    # The install script builds them: the main job and the tests compose them.
    from corral.config import NodeConfig
    from corral.progress import progress_bar

    cfg = NodeConfig.from_env()
    with progress_bar() as bar:
        ensure_all(ImageStore(cfg.images_dir), cfg.data_dir / "cache" / "sdists", bar)
