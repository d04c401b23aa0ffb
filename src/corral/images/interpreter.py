"""E2B's code-interpreter template as a Corral toolkit layer.

What it holds (on debian-python:bookworm + e2b-user:bookworm):
  - a Jupyter server, IPython's kernel, bash_kernel, and the libraries E2B's
    clients expect to display (pandas, matplotlib, numpy, orjson,
    e2b_charts): PyPI wheels for CPython 3.11 on glibc x86_64, pinned;
  - Deno (npm's @deno/linux-x64-glibc) as the JavaScript and TypeScript
    kernel;
  - Corral's code-interpreter server and its start script
    (images/interpreter-files/, run inside the sandbox; docs/e2b.md).

Built once, found again by its label (the pins are the key).

Under it, e2b-ci-langs is what E2B's template installs from its
distribution's packages, built in a sandbox (build/scripted.py) from
Debian's: the R kernel (IRkernel) and a JDK with Corral's Java kernel over
JShell (interpreter-langs-files/, docs/e2b.md). The command-line tools
(curl, git, jq, procps, pip, Node.js) are E2B's base template's, in
e2b-tools (images/e2b_tools.py), under both.

`python -m corral.cli.e2b_templates` builds them (the install script does).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

from corral.errors import Unavailable
from corral.images import e2b_tools, pypi
from corral.images.build import build_cached, files_digest
from corral.images.layer import Layer
from corral.images.store import ImageStore, ProgressFn

TAG = "e2b-code-interpreter:bookworm"
FILES = Path(__file__).with_name("interpreter-files")
HOME = "opt/corral/interpreter"
DENO = "@deno/linux-x64-glibc@2.9.6"
# The top of what the template's kernels import; pip resolves the rest
# (for the image's Python, whatever runs the build).
PYPI = [
    "jupyter-server==2.20.0",
    "ipykernel==6.31.0",
    "ipython==9.10.0",
    "bash_kernel==0.10.0",
    "orjson==3.11.9",
    "numpy==2.3.5",
    "pandas==2.2.3",
    "matplotlib==3.10.9",
    "e2b-charts==1.0.0",
]
# Entry points the template runs by name (pip --target writes none that
# would run in the image): the Jupyter server and IPython.
LAUNCHERS = {
    "jupyter": "jupyter_core.command:main",
    "jupyter-server": "jupyter_server.serverapp:main",
    "ipython": "IPython:start_ipython",
}
KERNELS = {
    "javascript": {
        "argv": ["/usr/local/bin/deno", "jupyter", "--kernel", "--conn", "{connection_file}"],
        "display_name": "Deno (JavaScript, TypeScript)",
        "language": "typescript",
        # Deno's cache: writable, and the same for every context.
        "env": {"DENO_DIR": "/root/.cache/deno", "NO_COLOR": "1"},
    },
    "bash": {
        "argv": ["/usr/bin/python3", "-m", "bash_kernel", "-f", "{connection_file}"],
        "display_name": "Bash",
        "language": "bash",
    },
}


LANGS_TAG = "e2b-ci-langs:bookworm"
LANGS_FILES = Path(__file__).with_name("interpreter-langs-files")
LANGS_HOME = "/opt/corral/interpreter/java"
# Debian bookworm's packages (their versions are the suite's).
LANGS_DEBIAN = ["r-cran-irkernel", "openjdk-17-jdk-headless"]


def langs_key() -> str:
    # Built over e2b-tools: a new tools layer builds this one again, so
    # that its copy of dpkg's status (on top) keeps the tools' packages.
    return (f"e2b-ci-langs:{','.join(LANGS_DEBIAN)}:{files_digest(LANGS_FILES)}:"
            f"{e2b_tools.key()}")  # fmt: skip


def key() -> str:
    files = sorted(FILES.iterdir())
    digest = hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in files))
    return "e2b-ci:" + ",".join([*PYPI, DENO]) + ":" + digest.hexdigest()[:16]


def _run(what: str, argv: list[str], cwd: Path | None = None) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=cwd)
    if proc.returncode != 0:
        raise Unavailable(f"{what} failed: {(proc.stderr or proc.stdout)[-1500:]}")


def _deno(stage: Path, cache: Path, progress: ProgressFn) -> None:
    progress("npm pack deno", 0, 1)
    cache.mkdir(parents=True, exist_ok=True)
    if shutil.which("npm") is None:
        raise Unavailable("npm is needed to fetch Deno (apt-get install npm)")
    tgz = cache / "deno-linux-x64-glibc-2.9.6.tgz"
    if not tgz.exists():
        _run("npm pack " + DENO, ["npm", "pack", "--silent", DENO], cwd=cache)
    with tarfile.open(tgz) as tar:
        member = tar.getmember("package/deno")
        src = tar.extractfile(member)
        assert src is not None
        out = stage / "usr/local/bin/deno"
        out.write_bytes(src.read())
        out.chmod(0o755)
    progress("npm pack deno", 1, 1)


def _python(stage: Path, progress: ProgressFn) -> None:
    pypi.install(stage, PYPI, "jupyter", progress)
    for name, entry in LAUNCHERS.items():
        pypi.launcher(stage, name, entry)


def build(store: ImageStore, cache: Path, progress: ProgressFn) -> Layer:
    def fill(stage: Path) -> None:
        (stage / "usr/local/bin").mkdir(parents=True)
        _python(stage, progress)
        _deno(stage, cache, progress)
        for name, spec in KERNELS.items():
            d = stage / "usr/local/share/jupyter/kernels" / name
            d.mkdir(parents=True)
            (d / "kernel.json").write_text(json.dumps(spec, indent=1))
        home = stage / HOME
        home.mkdir(parents=True)
        for f in FILES.iterdir():
            shutil.copy2(f, home / f.name)
        profile = stage / "root/.ipython/profile_default"
        (profile / "startup").mkdir(parents=True)
        shutil.copy2(FILES / "ipython_kernel_config.py", profile / "ipython_kernel_config.py")
        shutil.copy2(FILES / "formatters.py", profile / "startup/00-corral-formatters.py")
        os.chmod(stage / "root", 0o700)

    return build_cached(store, TAG, key(), fill, progress=progress)
