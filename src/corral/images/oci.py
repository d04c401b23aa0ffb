"""Import an OCI image (layout directory or archive) or a `docker save`
tarball: apply its layers in order, whiteouts and opaque directories
included, and squash the result into one layer. The image config's env,
working directory and user become the layer's defaults.

Layer tarballs come from outside: they are applied by a child process
chrooted into the staging tree, so an absolute symlink planted by one layer
(`etc -> /etc`) can only ever point inside the image, never at the host.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from corral.errors import InvalidArgument, Unavailable
from corral.images.build import build_from_dir
from corral.images.layer import ImageConfig, Layer
from corral.images.store import ImageStore, ProgressFn

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"


@dataclass(frozen=True)
class Archive:
    layers: list[Path]  # layer tarballs, bottom first
    config: dict[str, Any]


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgument("from_oci", f"must hold a readable {path.name}", str(exc)) from None


def _inside(root: Path, rel: str) -> Path:
    path = (root / rel).resolve()
    if not path.is_relative_to(root.resolve()):
        raise InvalidArgument("from_oci", "must not reference files outside the archive", rel)
    return path


def read_archive(root: Path) -> Archive:
    """Find the layers and config in an unpacked archive (OCI or docker)."""
    if (root / "index.json").exists():
        index = _json(root / "index.json")
        manifests = index.get("manifests") or []
        if not manifests:
            raise InvalidArgument("from_oci", "index.json must list a manifest", str(root))
        desc = manifests[0]
        manifest = _json(_inside(root, "blobs/" + desc["digest"].replace(":", "/")))
        if "manifests" in manifest:  # an image index: take its first image
            manifest = _json(
                _inside(root, "blobs/" + manifest["manifests"][0]["digest"].replace(":", "/"))
            )
        config = _json(_inside(root, "blobs/" + manifest["config"]["digest"].replace(":", "/")))
        layers = []
        for layer in manifest.get("layers", []):
            media = layer.get("mediaType", "")
            if "zstd" in media:
                raise InvalidArgument("from_oci", "layers must be tar or tar+gzip, not zstd", media)
            layers.append(_inside(root, "blobs/" + layer["digest"].replace(":", "/")))
        return Archive(layers, config)
    if (root / "manifest.json").exists():
        (entry, *_rest) = _json(root / "manifest.json")
        config = _json(_inside(root, entry["Config"]))
        return Archive([_inside(root, p) for p in entry["Layers"]], config)
    raise InvalidArgument(
        "from_oci", "must be an OCI image layout or a `docker save` tarball", str(root)
    )


def _remove(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _rel(name: str) -> str:
    """A member's name from the root: './etc' and '/etc' are 'etc', '.' is
    the root itself (''), and a name's own leading dot stays ('.wh.x',
    '.profile'): a prefix is removed, not a set of characters."""
    while True:
        stripped = name.lstrip("/")
        if stripped.startswith("./"):
            name = stripped[2:]
        elif stripped == ".":
            return ""
        else:
            return stripped


def _apply_layer(tar: tarfile.TarFile) -> None:
    """Inside the chroot: whiteouts first (they delete lower content),
    then the layer's own entries."""
    members = tar.getmembers()
    for m in members:
        name = "/" + _rel(m.name)
        parent, base = os.path.split(name)
        if base == OPAQUE:
            if os.path.isdir(parent) and not os.path.islink(parent):
                for child in os.listdir(parent):
                    _remove(os.path.join(parent, child))
        elif base.startswith(WHITEOUT):
            _remove(os.path.join(parent, base[len(WHITEOUT) :]))
    for m in members:
        rel = _rel(m.name)
        if not rel or os.path.basename(rel).startswith(WHITEOUT):
            continue
        path = "/" + rel
        try:
            st = os.lstat(path)
            # Replace what a lower layer had unless both are directories
            # (then they merge); never write through an existing symlink.
            if not (m.isdir() and stat.S_ISDIR(st.st_mode)):
                _remove(path)
        except FileNotFoundError:
            pass
        m.name = rel
        if m.islnk():
            m.linkname = _rel(m.linkname)
        tar.extract(m, "/", numeric_owner=True, filter="fully_trusted")


def _as_upper(tar: tarfile.TarFile) -> None:
    """Inside the chroot of an empty tree: the layer as an overlay upper
    directory, so that it composes over the layers under it at mount time.
    A whiteout becomes overlayfs's whiteout (a 0/0 character device), an
    opaque marker its opaque directory (the trusted.overlay.opaque xattr)."""
    for m in tar:
        rel = _rel(m.name)
        if not rel:
            continue
        parent, base = os.path.split("/" + rel)
        if base == OPAQUE:
            os.makedirs(parent, exist_ok=True)
            os.setxattr(parent, "trusted.overlay.opaque", b"y")
            continue
        if base.startswith(WHITEOUT):
            os.makedirs(parent, exist_ok=True)
            target = os.path.join(parent, base[len(WHITEOUT) :])
            _remove(target)
            os.mknod(target, stat.S_IFCHR, os.makedev(0, 0))
            continue
        path = "/" + rel
        try:
            st = os.lstat(path)
            if not (m.isdir() and stat.S_ISDIR(st.st_mode)):
                _remove(path)  # the same path twice in one layer: the last wins
        except FileNotFoundError:
            pass
        m.name = rel
        if m.islnk():
            m.linkname = _rel(m.linkname)
        tar.extract(m, "/", numeric_owner=True, filter="fully_trusted")


def apply_layers(
    staging: Path, layers: list[Path], progress: ProgressFn, label: str, *, as_upper: bool = False
) -> None:
    """Apply layer tarballs in a child process chrooted into staging: one
    over the other (squashed), or, `as_upper`, one layer as an overlay
    upper directory."""
    files: list[IO[bytes]] = [open(p, "rb") for p in layers]  # noqa: SIM115
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: only syscalls and tarfile from here on
        os.close(r)
        code = 0
        try:
            os.chroot(staging)
            os.chdir("/")
            for i, f in enumerate(files):
                with tarfile.open(fileobj=f, mode="r:*") as tar:
                    (_as_upper if as_upper else _apply_layer)(tar)
                os.write(w, f"layer {i + 1}\n".encode())
        except BaseException as exc:
            os.write(w, f"error {type(exc).__name__}: {exc}\n".encode())
            code = 1
        os._exit(code)
    os.close(w)
    for f in files:
        f.close()
    done, errors = 0, []
    with os.fdopen(r) as pipe:
        for line in pipe:
            if line.startswith("layer "):
                done += 1
                progress(label, done, len(layers))
            else:
                errors.append(line.strip())
    _, status = os.waitpid(pid, 0)
    if status != 0 or errors:
        raise InvalidArgument("from_oci", "must hold valid layer tarballs", "; ".join(errors))


def import_oci(
    store: ImageStore,
    source: Path,
    *,
    tag: str | None,
    kind: str = "base",
    progress: ProgressFn,
) -> Layer:
    if not source.exists():
        raise InvalidArgument("from_oci", "must be an existing archive or directory", str(source))
    work = store.tmpdir("oci")
    try:
        if source.is_dir():
            root = source
        else:
            root = work / "archive"
            root.mkdir()
            progress(f"unpack {source.name}", 0, None)
            try:
                with tarfile.open(source, "r:*") as tar:
                    tar.extractall(root, filter="data")
            except (tarfile.TarError, OSError) as exc:
                raise InvalidArgument(
                    "from_oci", "must be a readable tar archive", str(exc)
                ) from None
            progress(f"unpack {source.name}", 1, 1)
        archive = read_archive(root)
        staging = work / "rootfs"
        staging.mkdir()
        os.chmod(staging, 0o755)
        apply_layers(staging, archive.layers, progress, f"apply {len(archive.layers)} layers")
        cfg = archive.config.get("config") or {}
        config = ImageConfig(
            env=list(cfg.get("Env") or []),
            workdir=cfg.get("WorkingDir") or None,
            user=cfg.get("User") or None,
        )
        return build_from_dir(
            store,
            staging,
            tag=tag,
            kind=kind,
            config=config,
            labels={"corral.source": f"oci:{source.name}"},
            progress=progress,
        )
    except OSError as exc:
        raise Unavailable(f"importing {source}: {exc}") from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
