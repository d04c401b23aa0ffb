"""Pull an image from an OCI registry (docs/registries.md).

The registry protocol is skopeo's (Debian's package): token and basic
auth, docker login-style credentials files, manifest lists (the platform
picked is linux/amd64 unless asked), docker and OCI media types, digests
verified. It copies into one OCI image layout per node (the store's
`oci/`), which is also the blob cache: a layer already held is not fetched
again, and a pull that failed half-way resumes from the layers it
finished.

Each OCI layer then becomes one Corral layer, an overlay upper directory
(whiteouts as overlayfs whiteouts) on the layer under it, marked as part
of a stack (store.STACK): an image is its top layer's chain. Layers are
found again by their OCI chain id, so images sharing base layers share
Corral layers. The image's config (env, working directory, user) sits in
an empty top layer, tagged with the reference's local name
(`127.0.0.1_5000/team/app:1` for `127.0.0.1:5000/team/app:1`).

A pull that fails leaves no Corral layer or tag behind.
"""

from __future__ import annotations

import fcntl
import gzip
import hashlib
import json
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from corral.addresses import host_port, loopback_host
from corral.errors import (
    CorralError,
    ImageNotFound,
    InvalidArgument,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from corral.images.build import build_from_dir
from corral.images.egress import PullGuard
from corral.images.layer import DIGEST, MAX_STACK, STACK, ImageConfig, Layer, RegistryRef
from corral.images.oci import apply_layers
from corral.images.store import ImageStore, ProgressFn

CHAIN = "oci.chain_id"
IMAGE = "oci.image"
_CHUNK = 1 << 20
# One layer unpacked, at most (the largest CUDA layers are about 10 GB), and
# the free space a pull leaves its file system.
MAX_LAYER_BYTES = 64 << 30
FREE_FLOOR = 1 << 30
# A whole pull, at most. A registry that accepts and then stalls (or
# trickles) would otherwise hold the node's layout lock, and with it every
# other pull on the node, for ever. Half an hour is 18 GB at 10 MB/s.
PULL_TIMEOUT = 1800.0
KILL_GRACE = 30.0


@contextmanager
def locked_layout(layout: Path) -> Iterator[None]:
    # One skopeo at a time per layout: it rewrites index.json.
    layout.mkdir(parents=True, exist_ok=True)
    with open(layout / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def skopeo_error(ref: RegistryRef, text: str) -> CorralError:
    low = text.lower()
    tail = text.strip().splitlines()[-1][-400:] if text.strip() else "no output"
    if any(s in low for s in ("connection refused", "no such host", "i/o timeout", "dial tcp")):
        return Unavailable(f"registry {ref.host} cannot be reached: {tail}", ref=str(ref))
    if any(s in low for s in ("unauthorized", "authentication required", "denied")):
        return Unauthenticated(
            f"registry {ref.host} refused the credentials (a docker login-style file: "
            f"--authfile, or ~/.docker/config.json): {tail}"
        )
    if any(s in low for s in ("manifest unknown", "name unknown", "not found", "no image")):
        return ImageNotFound(f"{ref}: the registry has no such image", ref=str(ref))
    if "digest" in low and ("match" in low or "invalid" in low):
        return InvalidArgument("ref", "names content that does not match its digest", tail)
    return Unavailable(f"pulling {ref}: {tail}", ref=str(ref))


def _copy(ref: RegistryRef, layout: Path, key: str, authfile: Path | None,
          platform: str, progress: ProgressFn, guard: PullGuard | None) -> None:  # fmt: skip
    os_name, _, arch = platform.partition("/")
    timeout = PULL_TIMEOUT
    if guard is not None:
        # By name first, for a clear answer: Go would not send a loopback
        # address through the proxy (it could reach nothing in the pull's
        # namespace either way).
        try:
            guard.check_name(*host_port(ref.host))
        except PermissionError as exc:
            raise _refused(ref, str(exc)) from None
    argv = ["skopeo", "--command-timeout", f"{timeout:.0f}s", "copy",
            "--override-os", os_name, "--override-arch", arch or "amd64"]  # fmt: skip
    if loopback_host(ref.host):
        argv.append("--src-tls-verify=false")  # as Docker does for 127.0.0.0/8
    if authfile is not None:
        argv += ["--src-authfile", str(authfile)]
    argv += [f"docker://{ref}", f"oci:{layout}:{key}"]
    label = f"pull {ref}"
    progress(label, 0, None)
    try:
        pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        proc = guard.spawn(argv, **pipes) if guard is not None else subprocess.Popen(argv, **pipes)
    except FileNotFoundError:
        raise Unavailable("skopeo is not installed (Debian's skopeo package)") from None
    assert proc.stdout is not None and proc.stderr is not None
    # skopeo's own timeout ends its network calls; this kill is for a
    # skopeo stuck elsewhere (its stderr full, a dead NFS layout), so
    # the layout's lock is never held past the bound.
    watchdog = threading.Timer(timeout + KILL_GRACE, proc.kill)
    watchdog.start()
    try:
        blobs = 0
        for line in proc.stdout:
            if line.startswith("Copying blob"):
                blobs += 1
                progress(label, blobs, None)
        err = proc.stderr.read()
        code = proc.wait()
    finally:
        watchdog.cancel()
    if code != 0:
        if guard is not None and guard.refused:
            raise _refused(ref, guard.refused[0])
        if guard is not None and guard.unresolved:
            raise Unavailable(f"registry {ref.host} cannot be reached: {guard.unresolved[0]}",
                              ref=str(ref))  # fmt: skip
        if code == -signal.SIGKILL or "context deadline exceeded" in err:
            raise Unavailable(
                f"pulling {ref}: the registry did not deliver the image within "
                f"{timeout:.0f} s (images.pull.PULL_TIMEOUT)",
                ref=str(ref),
            )
        raise skopeo_error(ref, err)


def _refused(ref: RegistryRef, reason: str) -> InvalidArgument:
    return InvalidArgument(
        "ref",
        "must name a registry outside the cluster's network (a guarded node connects only to "
        "public addresses, or to the registries CORRAL_REGISTRIES lists)",
        f"{ref}: {reason}",
    )


def _blob(layout: Path, digest: str) -> Path:
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        raise InvalidArgument("ref", "has a descriptor with a digest that is not sha256", digest)
    return layout / "blobs" / "sha256" / digest[7:]


def _manifest(layout: Path, key: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    index = json.loads((layout / "index.json").read_text())
    name = "org.opencontainers.image.ref.name"
    found = [m for m in index.get("manifests", []) if (m.get("annotations") or {}).get(name) == key]
    if not found:
        raise Unavailable(f"skopeo left no manifest for {key} in {layout}")
    digest = found[-1]["digest"]
    manifest = json.loads(_blob(layout, digest).read_text())
    config = json.loads(_blob(layout, manifest["config"]["digest"]).read_text())
    return digest, manifest, config


def _decompressed(src: Path, media: str) -> IO[bytes]:
    if media.endswith("zstd"):
        proc = subprocess.Popen(["zstd", "-dcq", str(src)], stdout=subprocess.PIPE)
        assert proc.stdout is not None
        return proc.stdout
    with open(src, "rb") as f:
        magic = f.read(2)
    if media.endswith("gzip") or magic == b"\x1f\x8b":
        return gzip.open(src, "rb")  # type: ignore[return-value]
    return open(src, "rb")


def _free(path: Path) -> int:
    return shutil.disk_usage(path.parent).free


def _plain_tar(src: Path, media: str, diff_id: str, dest: Path) -> None:
    """The layer uncompressed at dest, checked against its diff_id."""
    if "tar" not in media and "layer" not in media:
        raise InvalidArgument("ref", "has a layer that is not a tar archive", media)
    h = hashlib.sha256()
    written = 0
    try:
        with _decompressed(src, media) as stream, open(dest, "wb") as out:
            while chunk := stream.read(_CHUNK):
                h.update(chunk)
                out.write(chunk)
                written += len(chunk)
                # The diff_id is checked at the end: until then the bytes
                # are the registry's choice (a gzip bomb), so they are bounded.
                if written > MAX_LAYER_BYTES:
                    raise InvalidArgument(
                        "ref", f"has a layer larger than {MAX_LAYER_BYTES} bytes unpacked", diff_id
                    )
                if written % (1 << 30) < len(chunk) and _free(dest) < FREE_FLOOR:
                    raise ResourceExhausted(
                        f"pulling stopped: the image store's file system has less than "
                        f"{FREE_FLOOR} bytes free",
                        resource="disk",
                    )
    except (OSError, EOFError) as exc:
        raise InvalidArgument("ref", "has a layer that does not decompress", str(exc)) from None
    if "sha256:" + h.hexdigest() != diff_id:
        raise InvalidArgument("ref", "has a layer whose content does not match its diff_id",
                              diff_id)  # fmt: skip


def _convert(store: ImageStore, src: Path, media: str, diff_id: str, chain_id: str,
             parent: str | None, ref: RegistryRef, progress: ProgressFn) -> Layer:  # fmt: skip
    work = store.tmpdir("pull")
    try:
        plain = work / "layer.tar"
        _plain_tar(src, media, diff_id, plain)
        upper = work / "upper"
        upper.mkdir()
        os.chmod(upper, 0o755)
        apply_layers(upper, [plain], progress, f"unpack {diff_id[:19]}", as_upper=True)
        labels = {STACK: "oci", CHAIN: chain_id, "oci.diff_id": diff_id,
                  "corral.source": f"oci:{ref}"}  # fmt: skip
        return build_from_dir(store, upper, tag=None, kind="base", parent=parent,
                              labels=labels, progress=progress)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)


def pull(
    store: ImageStore,
    text: str,
    progress: ProgressFn,
    *,
    authfile: Path | None = None,
    platform: str = "linux/amd64",
    guard: PullGuard | None = None,
) -> Layer:
    """Pull `text` (a registry reference, or Docker Hub's shorthand) and
    tag its top layer with the reference's local name; the image's top."""
    ref = RegistryRef.for_pull(text)
    layout = store.root / "oci"
    key = str(ref)
    with locked_layout(layout):
        _copy(ref, layout, key, authfile, platform, progress, guard)
        manifest_digest, manifest, config = _manifest(layout, key)
    layers = manifest.get("layers") or []
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
    if len(layers) >= MAX_STACK:  # its config is one more layer: checked before any is unpacked
        raise InvalidArgument("ref", f"has more than {MAX_STACK - 1} layers", len(layers))
    if len(layers) != len(diff_ids):
        raise InvalidArgument("ref", "has a config whose diff_ids do not match its layers",
                              f"{len(layers)} layers, {len(diff_ids)} diff_ids")  # fmt: skip
    made: list[str] = []
    try:
        parent: str | None = None
        chain = ""
        for i, (desc, diff_id) in enumerate(zip(layers, diff_ids, strict=True)):
            chain = diff_id if i == 0 else "sha256:" + hashlib.sha256(
                f"{chain} {diff_id}".encode()).hexdigest()  # fmt: skip
            layer = store.find_by_label(CHAIN, chain)
            if layer is None:
                src = _blob(layout, desc["digest"])
                layer = _convert(store, src, desc.get("mediaType", ""), diff_id, chain, parent,
                                 ref, progress)  # fmt: skip
                made.append(layer.digest)
            parent = layer.digest
        cfg = config.get("config") or {}
        image_config = ImageConfig(env=list(cfg.get("Env") or []),
                                   workdir=cfg.get("WorkingDir") or None,
                                   user=cfg.get("User") or None)  # fmt: skip
        top = store.find_by_label("oci.manifest", manifest_digest)
        if top is not None and top.parent == parent:  # pulled before: fetched nothing new
            store.tag(top.digest, f"{ref.local_name}:{ref.local_tag}")
            return top
        empty = store.tmpdir("pull-config")
        try:
            os.chmod(empty, 0o755)
            top = build_from_dir(
                store, empty, tag=None, kind="base", parent=parent, config=image_config,
                labels={STACK: "oci", IMAGE: key, "oci.manifest": manifest_digest,
                        "corral.source": f"oci:{ref}"},
                progress=progress,
            )  # fmt: skip
        finally:
            shutil.rmtree(empty, ignore_errors=True)
        made.append(top.digest)
        store.tag(top.digest, f"{ref.local_name}:{ref.local_tag}")
    except BaseException:
        for digest in made:  # nothing of a failed pull stays
            try:
                store.remove(digest)
            except CorralError:
                pass
        raise
    return store.get(top.digest)
