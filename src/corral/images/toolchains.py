"""The toolchains of SandboxFusion's languages, as one toolkit layer over
the function image (fncall:bookworm): Go, Java (with JUnit), Node.js (with
TypeScript and Jest), PHP, C# (Mono), Rust, Lua, R, Perl, D, Ruby, Scala,
Kotlin, Racket, SQLite and Verilog.

One layer, not one per language: the layer is loaded lazily, chunk by
chunk, so a call pays only for the toolchain it touches, and any warm
worker serves any language. It is built the way a user would build it: in
a Corral sandbox on fncall:bookworm whose network reaches Debian's and npm's
package sources and nothing else (toolchain-files/build.sh), then
committed. Built once, found again by its label (the key below).

`python -m corral.cli.toolchains` builds both layers (the install script
does); the build itself is there, since it drives a sandbox through the SDK.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from corral.images.build import build_cached, files_digest
from corral.images.layer import Layer
from corral.images.store import ImageStore, ProgressFn

TAG = "fncall-langs:bookworm"
# The small scripts the language table calls (runner-files/): their own
# layer, so changing one does not rebuild the toolchains.
RUNNERS_TAG = "fncall-runners:bookworm"
RUNNERS = Path(__file__).with_name("runner-files")
BASE = "fncall:bookworm"
FILES = Path(__file__).with_name("toolchain-files")
HOME = "/opt/corral/toolchains"
LABEL = "toolchains.source"
# Debian bookworm's packages (their versions are the suite's).
DEBIAN = [
    "ca-certificates",
    "golang-go",
    # Go's test libraries as SandboxFusion's Go runtime has them (testify),
    # from Debian: calls build in GOPATH mode against /usr/share/gocode.
    "golang-github-stretchr-testify-dev",
    "default-jdk-headless",
    "junit5",
    "libjavatuples-java",
    "nodejs",
    "npm",
    "php-cli",
    "mono-mcs",
    "mono-runtime",
    "rustc",
    "lua5.4",
    # LuaUnit 3.4, which SandboxFusion's Lua problems require ("lua-unit").
    "lua-unit",
    "r-base-core",
    "perl",
    # What SandboxFusion's Perl problems use.
    "libtest-deep-perl",
    "libdata-compare-perl",
    "ldc",
    "ruby",
    "scala",
    "kotlin",
    "racket",
    "sqlite3",
    "iverilog",
]
ECOSYSTEMS = ("debian", "npm")


def key() -> str:
    return "toolchains:" + ",".join(DEBIAN) + ":" + files_digest(FILES)


def build_runners(store: ImageStore, progress: ProgressFn) -> Layer:
    files = sorted(p for p in RUNNERS.rglob("*") if p.is_file())

    def fill(stage: Path) -> None:
        for f in files:
            out = stage / "opt/corral/runners" / f.relative_to(RUNNERS)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, out)
            out.chmod(0o755 if f.parent.name == "bin" else 0o644)

    key = "runners:" + files_digest(RUNNERS)
    return build_cached(store, RUNNERS_TAG, key, fill, progress=progress)
