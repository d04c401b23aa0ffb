"""Push an image to an OCI registry (docs/registries.md).

An image pulled from a registry goes back as it came: its manifest and
blobs are still in the node's OCI layout, and skopeo copies them byte for
byte. An image made in Corral (built, imported, committed) becomes an OCI
image of one layer per Corral layer of its stack: each layer's tree, read
from its EROFS mount, as a gzipped tar, overlayfs whiteouts turned back
into OCI's (`.wh.NAME`, `.wh..wh..opq`); its config (env, working
directory, user) the image config.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import stat
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

from corral.addresses import loopback_host
from corral.errors import InvalidArgument, Unavailable
from corral.host import mounts
from corral.images.layer import Layer, RegistryRef
from corral.images.mounter import LayerMounts
from corral.images.oci import OPAQUE, WHITEOUT
from corral.images.pull import IMAGE, locked_layout, skopeo_error
from corral.images.store import ImageStore, ProgressFn

_OCI_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _tar_layer(root: Path, out: Path) -> str:
    """The tree at root as an OCI layer tarball (gzip) at out; its diff_id."""
    raw = out.with_suffix(".tar")
    with tarfile.open(raw, "w", format=tarfile.PAX_FORMAT) as tar:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, root)
            if rel_dir != "." and _opaque(dirpath):
                tar.addfile(tarfile.TarInfo(os.path.join(rel_dir, OPAQUE)))
            for name in sorted(dirnames + filenames):
                path = os.path.join(dirpath, name)
                rel = os.path.normpath(os.path.join(rel_dir, name))
                st = os.lstat(path)
                if _is_whiteout(st):
                    tar.addfile(tarfile.TarInfo(os.path.join(os.path.dirname(rel),
                                                             WHITEOUT + name)))  # fmt: skip
                    continue
                info = tar.gettarinfo(path, rel)
                info.uname = info.gname = ""
                if info.isreg():
                    with open(path, "rb") as f:
                        tar.addfile(info, f)
                else:
                    tar.addfile(info)
    h = hashlib.sha256()
    with open(raw, "rb") as src, gzip.GzipFile(out, "wb", mtime=0) as dst:
        while chunk := src.read(1 << 20):
            h.update(chunk)
            dst.write(chunk)
    raw.unlink()
    return "sha256:" + h.hexdigest()


def _opaque(path: str) -> bool:
    try:
        return os.getxattr(path, "trusted.overlay.opaque", follow_symlinks=False) == b"y"
    except OSError:
        return False


def _when(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def _put(blobs: Path, path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    digest = h.hexdigest()
    size = path.stat().st_size
    os.replace(path, blobs / digest)
    return "sha256:" + digest, size


def _layout(store: ImageStore, chain: list[Layer], work: Path, progress: ProgressFn) -> Path:
    """An OCI image layout of the chain at work/layout, tagged `img`."""
    layout = work / "layout"
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    mnt = LayerMounts(store, work / "mnt")
    descs: list[dict[str, Any]] = []
    diff_ids: list[str] = []
    try:
        for i, layer in enumerate(chain):
            progress("export layers", i, len(chain))
            if layer.blob_size and not store.has_blob(layer.blob_digest):
                raise Unavailable(f"layer {layer.digest}: its data is not on this node (pulled "
                                  "lazily?); push from a node that holds it")  # fmt: skip
            root = mnt.ensure(layer)
            gz = work / f"layer{i}.tar.gz"
            diff_ids.append(_tar_layer(root, gz))
            mounts.umount(str(root))
            digest, size = _put(blobs, gz)
            descs.append({"mediaType": _OCI_LAYER, "digest": digest, "size": size})
        progress("export layers", len(chain), len(chain))
    finally:
        for point, _fs, _src in mounts.mounts_under(work / "mnt"):
            mounts.umount(point)
    top = chain[-1].config
    # history: one entry a layer, as builders that read the image expect
    # (buildah refuses an image whose history has fewer layers than it).
    history = [
        {"created": _when(x.created),
         "created_by": f"corral {x.labels.get('corral.source', x.kind)}"[:200]}
        for x in chain
    ]  # fmt: skip
    cfg = {"architecture": "amd64", "os": "linux", "created": _when(chain[-1].created),
           "config": {k: v for k, v in (("Env", top.env), ("WorkingDir", top.workdir),
                                        ("User", top.user)) if v},
           "rootfs": {"type": "layers", "diff_ids": diff_ids}, "history": history}  # fmt: skip
    (work / "config.json").write_text(json.dumps(cfg))
    cfg_digest, cfg_size = _put(blobs, work / "config.json")
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           "digest": cfg_digest, "size": cfg_size}, "layers": descs}  # fmt: skip
    (work / "manifest.json").write_text(json.dumps(manifest))
    m_digest, m_size = _put(blobs, work / "manifest.json")
    index = {"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": m_digest,
        "size": m_size, "annotations": {"org.opencontainers.image.ref.name": "img"}}]}  # fmt: skip
    (layout / "index.json").write_text(json.dumps(index))
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    return layout


def _skopeo_push(source: str, dest: RegistryRef, authfile: Path | None) -> None:
    argv = ["skopeo", "copy"]
    if loopback_host(dest.host):
        argv.append("--dest-tls-verify=false")
    if authfile is not None:
        argv += ["--dest-authfile", str(authfile)]
    try:
        done = subprocess.run([*argv, source, f"docker://{dest}"], capture_output=True, text=True)
    except FileNotFoundError:
        raise Unavailable("skopeo is not installed (Debian's skopeo package)") from None
    if done.returncode != 0:
        raise skopeo_error(dest, done.stderr)


def push(
    store: ImageStore,
    ref: str,
    dest_text: str,
    progress: ProgressFn,
    *,
    authfile: Path | None = None,
) -> RegistryRef:
    """Push the local image `ref` to the registry reference `dest_text`."""
    dest = RegistryRef.parse(dest_text, "dest")
    if dest is None:
        raise InvalidArgument("dest", "must be a registry reference like 'host[:port]/repo:tag'",
                              dest_text)  # fmt: skip
    top = store.resolve(ref, "ref")
    pulled = top.labels.get(IMAGE)
    if pulled:  # its manifest and blobs are in the node's OCI layout
        layout = store.root / "oci"
        with locked_layout(layout):
            _skopeo_push(f"oci:{layout}:{pulled}", dest, authfile)
        return dest
    work = store.tmpdir("push")
    try:
        layout = _layout(store, store.chain(top), work, progress)
        progress(f"push {dest}", 0, 1)
        _skopeo_push(f"oci:{layout}:img", dest, authfile)
        progress(f"push {dest}", 1, 1)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest
