"""Turn a directory, a root file system tarball or a Debian suite into a layer."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

from corral.errors import InvalidArgument, Unavailable
from corral.images.layer import ImageConfig, Layer
from corral.images.store import ImageStore, ProgressFn
from corral.log import get_logger

log = get_logger("corral.images")

CHUNK_SIZE = 64 * 1024  # small chunks fetch least (../shared/HOST-NOTES.md)
DEFAULT_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _no_progress(task: str, done: float, total: float | None) -> None:
    pass


def _count_entries(root: Path) -> int:
    n = 0
    for _dir, dirs, files in os.walk(root):
        n += len(dirs) + len(files)
    return n


def _tree_size(root: Path) -> int:
    total = 0
    for d, _dirs, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(d, f)).st_size
            except OSError:
                pass
    return total


def device_nodes(root: Path) -> list[str]:
    """Block and character device nodes in a tree about to become a layer,
    relative to it. They are left out of every layer: inside a sandbox /dev
    is its own, and on the host a device node in a layer is an open door
    to whoever reaches it. Overlay whiteouts (character device 0:0) are not
    listed: they are how a layer deletes a lower layer's file."""
    found = []
    for d, dirs, files in os.walk(root):
        for name in (*files, *dirs):
            path = os.path.join(d, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            whiteout = stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
            if (stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)) and not whiteout:
                found.append(os.path.relpath(path, root))
    return sorted(found)


def build_from_dir(
    store: ImageStore,
    src: Path,
    *,
    tag: str | None,
    kind: str = "layer",
    config: ImageConfig | None = None,
    labels: dict[str, str] | None = None,
    parent: str | None = None,
    progress: ProgressFn = _no_progress,
    wrap: list[str] | None = None,
    measure: Path | None = None,
) -> Layer:
    """mkfs.erofs the tree at src into a (metadata, chunked blob) layer.

    `wrap` prefixes the mkfs command (corral-nsexec with a --view, when src
    exists only in that command's mount namespace); `measure` is then where
    the same tree can be sized from here."""
    measure = measure or src
    if not measure.is_dir():
        raise InvalidArgument("from_dir", "must be an existing directory", str(measure))
    # The source is never changed (it may be the caller's own directory):
    # its devices are left out of the image instead.
    devices = device_nodes(measure)
    if devices:
        log.info("layer.devices_left_out", source=str(measure), count=len(devices))
    total = _count_entries(measure)
    work = store.tmpdir("build")
    meta, blob = work / "meta.erofs", work / "blob"
    cmd = [
        *(wrap or []),
        "mkfs.erofs",
        f"--chunksize={CHUNK_SIZE}",
        f"--blobdev={blob}",
        *(f"--exclude-path={d}" for d in devices),
        str(meta),
        str(src),
    ]
    label = f"layer {tag or src.name}"
    progress(label, 0, total)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        done, tail = 0, b""
        buf = b""
        while chunk := proc.stdout.read(8192):
            buf += chunk
            n = buf.count(b"Processing ")
            if n:
                done += n
                progress(label, min(done, total), total)
                buf = buf[buf.rfind(b"Processing ") + 11 :]
            tail = (tail + chunk)[-4000:]
        if proc.wait() != 0:
            text = re.sub(rb"\x1b\[[0-9;]*[A-Za-z]", b"", tail).decode(errors="replace")
            raise Unavailable(f"mkfs.erofs failed on {src}: {text.strip()[-800:]}")
        progress(label, total, total)
        if not blob.exists():  # a tree with no file data
            blob.write_bytes(b"")
        return store.add(
            meta,
            blob,
            chunk_size=CHUNK_SIZE,
            kind=kind,
            config=config,
            labels=labels,
            parent=parent,
            content_size=_tree_size(measure),
            tag=tag,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def files_digest(root: Path) -> str:
    """A digest of every file under `root`, its path and its bytes: the
    part of a cached layer's key that its source folder makes."""
    digest = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return digest.hexdigest()[:16]


def build_cached(
    store: ImageStore,
    tag: str,
    key: str,
    fill: Callable[[Path], None],
    *,
    kind: str = "toolkit",
    progress: ProgressFn = _no_progress,
) -> Layer:
    """The layer labelled corral.source=`key` (tagged `tag` again), or a
    new one from the tree `fill(stage)` makes: a pinned build runs once."""
    layer = store.find_by_label("corral.source", key)
    if layer is not None:
        store.tag(layer.digest, tag)
        return layer
    stage = store.tmpdir(tag.partition(":")[0])
    try:
        fill(stage)
        return build_from_dir(
            store, stage, tag=tag, kind=kind, labels={"corral.source": key}, progress=progress
        )
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def build_from_tar(
    store: ImageStore,
    tarball: Path,
    *,
    tag: str | None,
    kind: str = "base",
    config: ImageConfig | None = None,
    labels: dict[str, str] | None = None,
    progress: ProgressFn = _no_progress,
) -> Layer:
    """A root file system tarball (as `docker export` or `tar -C root -c .`)."""
    if not tarball.is_file():
        raise InvalidArgument("tarball", "must be an existing file", str(tarball))
    work = store.tmpdir("tar")
    try:
        progress(f"extract {tarball.name}", 0, None)
        proc = subprocess.run(
            ["tar", "--numeric-owner", "-xpf", str(tarball), "-C", str(work)],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise InvalidArgument("tarball", "must be a readable tar archive", proc.stderr[-500:])
        progress(f"extract {tarball.name}", 1, 1)
        return build_from_dir(
            store, work, tag=tag, kind=kind, config=config, labels=labels, progress=progress
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def apt_mirror() -> str:
    """The Debian mirror this host's apt uses, so debootstrap goes the same way."""
    candidates = [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]
    for path in candidates:
        try:
            text = path.read_text()
        except OSError:
            continue
        m = re.search(r"^URIs:\s*(\S+/debian)/?\s*$", text, re.M) or re.search(
            r"^deb\s+(?:\[[^\]]*\]\s+)?(\S+/debian)/?\s", text, re.M
        )
        if m:
            return m.group(1)
    return "http://deb.debian.org/debian"


def build_debootstrap(
    store: ImageStore,
    suite: str,
    packages: list[str],
    *,
    tag: str | None,
    mirror: str | None = None,
    progress: ProgressFn = _no_progress,
) -> Layer:
    """A minbase Debian root with extra packages; cached by (suite, packages)."""
    if not re.match(r"^[a-z]+$", suite):
        raise InvalidArgument("suite", "must be a Debian suite name like 'bookworm'", suite)
    for pkg in packages:
        if not re.match(r"^[a-z0-9][a-z0-9+.-]+$", pkg):
            raise InvalidArgument("packages", "must be Debian package names", pkg)
    key = hashlib.sha256(f"{suite}|{','.join(sorted(packages))}".encode()).hexdigest()[:16]
    cached = store.find_by_label("corral.source", f"debootstrap:{key}")
    if cached:
        log.info("image.cached", source=f"debootstrap:{suite}", digest=cached.digest)
        if tag:
            store.tag(cached.digest, tag)
        return store.get(cached.digest)

    work = store.tmpdir("debootstrap")
    root = work / "root"
    cmd = ["debootstrap", "--variant=minbase"]
    if packages:
        cmd.append("--include=" + ",".join(packages))
    cmd += [suite, str(root), mirror or apt_mirror()]
    label = f"debootstrap {suite}"
    try:
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        assert proc.stdout is not None
        steps, tail = 0, list[str]()
        for line in proc.stdout:
            tail = [*tail[-30:], line]
            if line.startswith("I: "):
                steps += 1
                progress(label, steps, None)
        if proc.wait() != 0:
            raise Unavailable(f"debootstrap failed: {''.join(tail)[-1500:]}")
        for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (root / leftover).glob("*"):
                if entry.is_file():
                    entry.unlink()
        config = ImageConfig(env=[DEFAULT_PATH, "LANG=C.UTF-8"], workdir="/")
        return build_from_dir(
            store,
            root,
            tag=tag,
            kind="base",
            config=config,
            labels={"corral.source": f"debootstrap:{key}", "corral.suite": suite},
            progress=progress,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
