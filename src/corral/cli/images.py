"""`corral image ...`: build, import, list, inspect, untag, push, pull and
gc layers in this host's layer store."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.table import Table

from corral.cli.args import given_command, node_config, open_client
from corral.cli.output import emit
from corral.errors import InvalidArgument
from corral.progress import progress_bar
from corral.units import format_size

if TYPE_CHECKING:
    from corral.images.layer import Layer
    from corral.images.store import ImageStore


def _store(a: argparse.Namespace) -> ImageStore:
    from corral.images.store import ImageStore

    return ImageStore(node_config(a).images_dir)


def _layer_doc(layer: Layer) -> dict[str, Any]:
    """A layer's manifest as shown: with its names, and a count of chunks
    instead of the list of their digests."""
    doc: dict[str, Any] = layer.to_json()
    doc["names"] = layer.names
    doc["chunks"] = len(doc.pop("chunk_digests"))
    return doc


async def image_build(a: argparse.Namespace) -> int:
    from corral.images import build

    store = _store(a)
    if a.run:
        return await _image_run(a)
    if a.file:
        return await _image_dockerfile(a)
    if a.desktop == "xfce":
        return await _image_xfce(a)
    with progress_bar(disable=a.json) as progress:
        if a.from_oci:
            from corral.images.oci import import_oci

            layer = await asyncio.to_thread(
                import_oci,
                store,
                a.from_oci,
                tag=a.ref,
                kind=a.kind or "base",
                progress=progress,
            )
        elif a.from_dir:
            layer = await asyncio.to_thread(
                build.build_from_dir,
                store,
                a.from_dir,
                tag=a.ref,
                kind=a.kind or "layer",
                progress=progress,
            )
        elif a.desktop:
            from corral.runtimes.vm import desktop

            base, _toolkit = await asyncio.to_thread(desktop.ensure, store, progress)
            store.tag(base.digest, a.ref)
            layer = base
        elif a.from_tar:
            layer = await asyncio.to_thread(
                build.build_from_tar,
                store,
                a.from_tar,
                tag=a.ref,
                kind=a.kind or "base",
                progress=progress,
            )
        else:
            packages = [p for p in a.packages.split(",") if p]
            layer = await asyncio.to_thread(
                build.build_debootstrap,
                store,
                a.debootstrap,
                packages,
                tag=a.ref,
                progress=progress,
            )
    emit(
        a,
        _layer_doc(layer),
        f"{a.ref} {layer.digest} "
        f"({format_size(layer.content_size)} content, {format_size(layer.meta_size)} metadata)",
    )
    return 0


async def _image_xfce(a: argparse.Namespace) -> int:
    """The XFCE desktop: its base from its Dockerfile (Corral's builder, on
    the small desktop's base), then its session toolkit."""
    from corral.runtimes.vm import desktop, xfce

    store = _store(a)
    with progress_bar(disable=a.json) as progress:
        await asyncio.to_thread(desktop.ensure, store, progress)
        toolkit = await asyncio.to_thread(xfce.ensure_toolkit, store, progress)
    a.file, a.cmd = xfce.DOCKERFILE, [str(xfce.DOCKERFILE.parent)]
    a.build_arg, a.no_cache = [], False
    await _image_dockerfile(a)
    emit(a, _layer_doc(toolkit), f"{xfce.TOOLKIT} {toolkit.digest}")
    return 0


async def _image_dockerfile(a: argparse.Namespace) -> int:
    """`image build REF -f DOCKERFILE [CONTEXT]`, with a line per step."""
    from corral.build.builder import Builder, Options

    args = {}
    for item in a.build_arg:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise InvalidArgument("build_arg", "must be NAME=VALUE", item)
        args[name] = value
    if len(a.cmd) > 1:
        raise InvalidArgument("context", "must be one directory", " ".join(a.cmd))
    context = Path(a.cmd[0] if a.cmd else ".")
    try:
        text = a.file.read_text()
    except OSError as exc:
        raise InvalidArgument("file", "must be a readable Dockerfile", str(exc)) from None

    def step(i: int, n: int, what: str) -> None:
        if not a.json:
            sys.stderr.write(f"step {i}/{n}: {what.splitlines()[0][:100]}\n")

    def out(text: str) -> None:
        if not a.json:
            sys.stderr.write(text)

    t0 = time.monotonic()
    async with open_client(a) as client:
        builder = Builder(client, context, Options(a.ref, build_args=args, no_cache=a.no_cache),
                          on_step=step, on_output=out)  # fmt: skip
        result = await builder.build(text)
    cached = sum(s.cached for s in result.steps)
    emit(
        a,
        {"image": result.image.model_dump(), "steps": [vars(s) for s in result.steps],
         "seconds": time.monotonic() - t0},
        f"built {a.ref} {result.image.digest[:19]}: {len(result.steps)} layer steps, "
        f"{cached} from cache, {time.monotonic() - t0:.1f} s",
    )  # fmt: skip
    return 0


async def _image_run(a: argparse.Namespace) -> int:
    """`image build --run BASE -- CMD`: what CMD changes becomes the layer."""
    cmd = given_command(a.cmd)
    async with open_client(a) as client:
        sbx = await client.sandboxes.create(
            image=a.run,
            workspace=a.workspace,
            toolkit=a.toolkit,
            ttl=a.timeout + 600,
            idle_timeout=None,
            labels={"corral.build": a.ref},
        )
        try:
            r = await sbx.commands.run(
                cmd,
                timeout=a.timeout,
                on_stdout=None if a.json else lambda t: sys.stderr.write(t),
                on_stderr=None if a.json else lambda t: sys.stderr.write(t),
            )
            if r.exit_code != 0:
                raise InvalidArgument(
                    "cmd", "must succeed to be committed", f"exit {r.exit_code}: {r.stderr[-300:]}"
                )
            layer = await sbx.commit(a.ref, kind=a.kind or "layer")
        finally:
            await sbx.close()
    emit(a, layer.model_dump(), f"{a.ref} {layer.digest} ({format_size(layer.content_size)})")
    return 0


async def image_push(a: argparse.Namespace) -> int:
    from corral.images import registry
    from corral.images.layer import RegistryRef
    from corral.images.objects import open_store, operator_key

    if RegistryRef.parse(a.store, "store") is not None:  # an OCI registry
        from corral.images.push import push

        with progress_bar(disable=a.json) as progress:
            dest = await asyncio.to_thread(
                push, _store(a), a.ref, a.store, progress, authfile=a.authfile
            )
        emit(a, {"ref": a.ref, "pushed": str(dest)}, f"pushed {a.ref} to {dest}")
        return 0

    remote = open_store(a.store, operator_key())
    with progress_bar(disable=a.json) as progress:
        layer = await asyncio.to_thread(registry.push, _store(a), a.ref, remote, progress)
    emit(a, _layer_doc(layer), f"pushed {a.ref} {layer.digest[:19]} to {a.store}")
    return 0


async def image_pull(a: argparse.Namespace) -> int:
    from corral.images import registry
    from corral.images.objects import open_store, operator_key

    if a.store is None:  # an OCI registry
        from corral.images.pull import pull

        with progress_bar(disable=a.json) as progress:
            layer = await asyncio.to_thread(
                pull, _store(a), a.ref, progress, authfile=a.authfile, platform=a.platform
            )
        layers = len(_store(a).chain(layer)) - 1
        emit(a, _layer_doc(layer), f"pulled {a.ref} as {layer.names[0]}: {layers} layers")
        return 0
    remote = open_store(a.store, operator_key())
    with progress_bar(disable=a.json) as progress:
        layer = await asyncio.to_thread(
            registry.pull, _store(a), a.ref, remote, progress, eager=a.eager
        )
    emit(
        a,
        _layer_doc(layer),
        f"pulled {a.ref} {layer.digest[:19]} from {a.store} (its data loads on first read)",
    )
    return 0


async def image_gc(a: argparse.Namespace) -> int:
    from corral.node.store import ACTIVE_STATES, Store

    cfg = node_config(a)
    in_use: set[str] = set()
    if cfg.db_path.exists():
        db = Store(cfg.db_path)
        in_use = {d for r in db.list(ACTIVE_STATES) for d in r.layers}
        db.close()
    removed, freed = _store(a).gc(in_use)
    emit(
        a,
        {"layers_removed": removed, "bytes_freed": freed},
        f"removed {removed} layers, freed {format_size(freed)}",
    )
    return 0


async def image_import(a: argparse.Namespace) -> int:
    from corral.images import build

    store = _store(a)
    with progress_bar(disable=a.json) as progress:
        layer = await asyncio.to_thread(
            build.build_from_tar, store, a.tarball, tag=a.ref, kind=a.kind, progress=progress
        )
    emit(a, _layer_doc(layer), f"{a.ref} {layer.digest}")
    return 0


async def image_ls(a: argparse.Namespace) -> int:
    layers = _store(a).list()
    table = Table("NAMES", "KIND", "DIGEST", "CONTENT", "META", "BLOB")
    for layer in layers:
        table.add_row(
            ",".join(layer.names) or "<none>",
            layer.kind,
            layer.digest[:19],
            format_size(layer.content_size),
            format_size(layer.meta_size),
            format_size(layer.blob_size),
        )
    emit(a, [_layer_doc(layer) for layer in layers], table)
    return 0


async def image_inspect(a: argparse.Namespace) -> int:
    layer = _store(a).resolve(a.ref)
    doc = _layer_doc(layer)
    print(json.dumps(doc, indent=None if a.json else 2))
    return 0


async def image_rm(a: argparse.Namespace) -> int:
    store = _store(a)
    for ref in a.refs:
        digest = store.untag(ref)
        if not a.json:
            print(f"untagged {ref} ({digest[:19]})")
    return 0
