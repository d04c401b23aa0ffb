"""Handlers of the `corral` commands."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import runpy
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from corral.cli.main import _create_kwargs, _labels
from corral.config import NodeConfig
from corral.errors import InvalidArgument
from corral.progress import progress_bar
from corral.sdk.client import AsyncClient
from corral.units import format_size

console = Console(stderr=False)


def _client(a: argparse.Namespace) -> AsyncClient:
    return AsyncClient(a.url, api_key=a.api_key, data_dir=a.data_dir)


def _emit(a: argparse.Namespace, doc: Any, table: Table | str | None = None) -> None:
    if a.json or table is None:
        print(json.dumps(doc, default=str, indent=None if a.json else 2))
    else:
        console.print(table)


def _config(a: argparse.Namespace) -> NodeConfig:
    return NodeConfig.from_env(data_dir=a.data_dir)


async def serve(a: argparse.Namespace) -> int:
    from corral.server import serve as run_server
    from corral.server import serve_gateway

    if a.gateway:
        if not a.state:
            raise InvalidArgument("state", "a gateway needs a state store (--state)", None)
        await serve_gateway(
            a.state,
            host=a.host,
            port=a.port,
            node_key=a.node_key,
            node_timeout=a.node_timeout,
            log_level=a.log_level,
        )
        return 0
    await run_server(
        NodeConfig.from_env(data_dir=a.data_dir, node=a.node),
        host=a.host,
        port=a.port,
        socket=a.socket,
        api_key=a.api_key,
        log_level=a.log_level,
        state=a.state,
        advertise=a.advertise,
    )
    return 0


# ---------------------------------------------------------------- projects


async def _state(a: argparse.Namespace) -> Any:
    from corral.cluster.up import load
    from corral.control.db import connect
    from corral.control.schema import migrate

    url = a.state or load(a.cluster_dir)["state"]
    db = await connect(url)
    await migrate(db)
    return db


async def project_help(a: argparse.Namespace) -> int:
    return 0


async def project_create(a: argparse.Namespace) -> int:
    from corral.control import quotas
    from corral.units import parse_size

    db = await _state(a)
    try:
        p = await quotas.create_project(
            db,
            a.name,
            parent=a.parent,
            max_sandboxes=a.max_sandboxes,
            max_cpu=a.max_cpu,
            max_memory=parse_size(a.max_memory, "max_memory") if a.max_memory else None,
        )
    finally:
        await db.aclose()
    _emit(a, p.__dict__, f"project {p.name} created")
    return 0


async def project_ls(a: argparse.Namespace) -> int:
    from corral.control import quotas

    db = await _state(a)
    try:
        projects = await quotas.list_projects(db)
    finally:
        await db.aclose()
    table = Table("project", "parent", "sandboxes", "cpu", "memory")

    def cell(used: float, limit: float | None, fmt: Any = str) -> str:
        return f"{fmt(used)} / {'-' if limit is None else fmt(limit)}"

    for p in projects:
        table.add_row(
            p.name,
            p.parent or "",
            cell(p.used_sandboxes, p.max_sandboxes),
            cell(p.used_cpu, p.max_cpu, lambda v: f"{v:g}"),
            cell(p.used_memory, p.max_memory, format_size),
        )
    _emit(a, [p.__dict__ for p in projects], table)
    return 0


async def project_key(a: argparse.Namespace) -> int:
    from corral.control import quotas

    db = await _state(a)
    try:
        key = await quotas.create_key(db, a.name)
    finally:
        await db.aclose()
    _emit(a, {"project": a.name, "api_key": key}, key)
    return 0


# ---------------------------------------------------------------- cluster


async def cluster_help(a: argparse.Namespace) -> int:
    return 0


async def cluster_up(a: argparse.Namespace) -> int:
    from corral.cluster.up import up

    doc = await up(
        a.dir,
        local_nodes=a.local_nodes,
        ray_address=a.ray_address,
        ray_port=a.ray_port,
        state=a.state,
        pg_port=a.pg_port,
        gateway_host=a.gateway_host,
        gateway_port=a.gateway_port,
        node_port=a.node_port,
        node_timeout=a.node_timeout,
        images=a.images,
        say=lambda line: console.print(line, highlight=False),
    )
    if a.json:
        print(json.dumps({"gateway": doc["gateway"], "nodes": doc["nodes"]}))
    return 0


async def cluster_status(a: argparse.Namespace) -> int:
    from corral.cluster.up import status

    rows = await status(a.dir)
    table = Table("node", "url", "state", "heartbeat", "sandboxes", "gateway's", "memory promised")
    for n in rows:
        c = n.capacity
        promised = format_size(c.get("memory_promised", 0))
        table.add_row(
            n.name,
            n.url,
            n.state,
            f"{n.heartbeat_age:.1f} s ago",
            f"{c.get('active', 0)} / {c.get('max_sandboxes', 0)}",
            str(c.get("held", 0)),
            f"{promised} / {format_size(c.get('memory_budget', 0))}",
        )
    _emit(a, [n.__dict__ for n in rows], table)
    return 0


async def cluster_down(a: argparse.Namespace) -> int:
    from corral.cluster.up import down

    await down(a.dir, say=lambda line: console.print(line, highlight=False))
    return 0


async def create(a: argparse.Namespace) -> int:
    async with _client(a) as client:
        sbx = await client.sandboxes.create(**_create_kwargs(a))
        _emit(a, sbx.info.model_dump(mode="json"), sbx.id)
    return 0


def _cmd(parts: list[str]) -> str | list[str]:
    if not parts:
        raise InvalidArgument("cmd", "must be given after --", parts)
    return parts[0] if len(parts) == 1 else parts


async def _run_in(sbx: Any, a: argparse.Namespace, cmd: str | list[str]) -> int:
    def out(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def err(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    r = await sbx.commands.run(
        cmd,
        timeout=a.timeout,
        cwd=getattr(a, "cwd", None),
        user=getattr(a, "user", "root"),
        on_stdout=None if a.json else out,
        on_stderr=None if a.json else err,
    )
    if a.json:
        print(json.dumps(r.__dict__))
    code: int = r.exit_code if r.exit_code >= 0 else 128 + r.signal
    return code


async def screenshot(a: argparse.Namespace) -> int:
    from corral.runtimes.vm.display import png_size

    async with _client(a) as client:
        sbx = await client.sandboxes.get(a.id)
        png = await sbx.display.screenshot()
    out = a.output or Path(f"{a.id}.png")
    out.write_bytes(png)
    w, h = png_size(png)
    _emit(a, {"path": str(out), "width": w, "height": h, "bytes": len(png)}, f"{out} {w}x{h}")
    return 0


async def suspend(a: argparse.Namespace) -> int:
    async with _client(a) as client:
        info = await (await client.sandboxes.get(a.id)).suspend()
    _emit(a, info.model_dump(mode="json"), f"{info.id} {info.state.value}")
    return 0


async def resume(a: argparse.Namespace) -> int:
    async with _client(a) as client:
        info = await (await client.sandboxes.get(a.id)).resume()
    _emit(a, info.model_dump(mode="json"), f"{info.id} {info.state.value}")
    return 0


async def exec_(a: argparse.Namespace) -> int:
    async with _client(a) as client:
        sbx = await client.sandboxes.get(a.id)
        return await _run_in(sbx, a, _cmd(a.cmd))


async def run(a: argparse.Namespace) -> int:
    async with _client(a) as client:
        sbx = await client.sandboxes.create(**_create_kwargs(a))
        try:
            return await _run_in(sbx, a, _cmd(a.cmd))
        finally:
            await sbx.close()


async def call(a: argparse.Namespace) -> int:
    from corral.errors import InvalidArgument

    def read(path: Path, what: str) -> bytes:
        try:
            return path.read_bytes()
        except OSError as exc:
            raise InvalidArgument(
                what, f"must be a readable file ({exc.strerror})", str(path)
            ) from None

    source = sys.stdin.read() if a.source == "-" else read(Path(a.source), "source").decode()
    async with _client(a) as client:
        r = await client.fncall.run(
            a.language,
            source,
            stdin=read(a.stdin, "stdin") if a.stdin else None,
            files={f.name: read(f, "file") for f in a.file},
            fetch_files=[Path(n).name for n in a.fetch],
            run_timeout=a.timeout,
            compile_timeout=a.compile_timeout,
            memory=a.memory,
            image=a.image,
        )
    if a.json:
        print(r.model_dump_json())
    else:
        sys.stdout.write(r.compile_output if r.status == "compile_error" else r.stdout)
        sys.stderr.write(r.stderr)
        for name, data in r.files.items():
            sys.stdout.write(f"--- {name} ---\n{data.decode(errors='replace')}")
        print(
            f"[{r.status}] exit {r.exit_code}, {r.wall_time * 1000:.0f} ms, "
            f"peak {r.peak_memory // 1024} KiB",
            file=sys.stderr,
        )
    if r.status == "ok":
        return 0
    return r.exit_code if r.exit_code and r.exit_code > 0 else 1


async def ls(a: argparse.Namespace) -> int:
    async with _client(a) as client:
        boxes = await client.sandboxes.list(_labels(a.label) or None)
    table = Table("ID", "KIND", "STATE", "IMAGE", "MEMORY", "AGE", "LABELS")
    now = time.time()
    for s in boxes:
        i = s.info
        table.add_row(
            i.id,
            i.kind,
            i.state.value,
            i.image,
            format_size(i.memory),
            f"{now - i.created_at:.0f}s",
            ",".join(f"{k}={v}" for k, v in i.labels.items()),
        )
    _emit(a, [s.info.model_dump(mode="json") for s in boxes], table)
    return 0


async def rm(a: argparse.Namespace) -> int:
    async with _client(a) as client:
        for sid in a.ids:
            sbx = await client.sandboxes.get(sid)
            await sbx.close()
            if not a.json:
                print(sid)
    return 0


async def gc(a: argparse.Namespace) -> int:
    from corral.node.agent import NodeAgent
    from corral.node.maintenance import GcReport

    async with NodeAgent(_config(a)) as agent:
        # Starting the agent already recovered the node if it became leader.
        report = GcReport()
        if agent._maintenance.recovered:
            report.add(agent._maintenance.recovered)
        again = await agent._maintenance.recover()
        report.add(again)
        report.reattached = again.reattached
    _emit(
        a,
        report.__dict__,
        f"reattached {report.reattached}, reclaimed "
        f"{report.reclaimed_sandboxes} sandboxes, resources {report.reclaimed or '{}'}, "
        f"released {report.layers_released} layer mounts",
    )
    return 0


def _guest_version() -> str | None:
    """The built guest artefacts' version (the install script builds them)."""
    from corral.runtimes.vm.guest import DEFAULT_OUT

    found = sorted(p.parent.name for p in DEFAULT_OUT.glob("*/ready"))
    return found[0] if found else None


async def doctor(a: argparse.Namespace) -> int:
    from corral.node import cgroups
    from corral.runtimes.container import bundle
    from corral.runtimes.vm.qemu import accelerator

    checks: dict[str, Any] = {
        "root": os.geteuid() == 0,
        "cgroups": cgroups.detect().value,
        "crun": shutil.which("crun"),
        "runc": shutil.which("runc"),
        "mkfs.erofs": shutil.which("mkfs.erofs"),
        "mkfs.btrfs": shutil.which("mkfs.btrfs"),
        "busybox": shutil.which("busybox"),
        "bash-static": shutil.which("bash-static"),
        "debootstrap": shutil.which("debootstrap"),
        "erofs": "erofs" in Path("/proc/filesystems").read_text(),
        "overlay": "overlay" in Path("/proc/filesystems").read_text(),
        "btrfs": "btrfs" in Path("/proc/filesystems").read_text(),
        "cap_sys_resource": bundle.CAN_PROTECT_INIT,
        "platform_helpers": (NodeConfig().platform_src / "bin" / "corral-init").exists(),
        # VMs: QEMU, the accelerator a guest would get, whether /dev/kvm is
        # there at all (present is not usable on nested PVM hosts), and the
        # guest artefacts' version if built.
        "qemu": shutil.which("qemu-system-x86_64"),
        "vm_accel": accelerator() if shutil.which("qemu-system-x86_64") else None,
        "dev_kvm": os.path.exists("/dev/kvm"),
        "guest": _guest_version(),
    }
    table = Table("CHECK", "RESULT")
    for k, v in checks.items():
        table.add_row(k, str(v))
    _emit(a, checks, table)
    return 0


async def demo(a: argparse.Namespace) -> int:
    from corral.rollout.demo import run_demo

    return await run_demo(_config(a), sandboxes=a.sandboxes, as_json=a.json)


async def bench(a: argparse.Namespace) -> int:
    bench_dir = Path(__file__).resolve().parents[3] / "bench"
    names = sorted(p.stem for p in bench_dir.glob("*.py") if not p.name.startswith("_"))
    if not a.name:
        print("benchmarks:", " ".join(names))
        return 0
    if a.name not in names:
        raise InvalidArgument("name", f"must be one of {', '.join(names)}", a.name)
    sys.argv = [str(bench_dir / f"{a.name}.py"), *a.args]
    await asyncio.to_thread(runpy.run_path, str(bench_dir / f"{a.name}.py"), run_name="__main__")
    return 0


# ------------------------------------------------------------------ images


async def image_help(a: argparse.Namespace) -> int:
    return 0


def _store(a: argparse.Namespace) -> Any:
    from corral.images.store import ImageStore

    return ImageStore(_config(a).images_dir)


def _layer_doc(layer: Any) -> dict[str, Any]:
    doc: dict[str, Any] = layer.to_json()
    doc["names"] = layer.names
    doc["chunks"] = len(doc.pop("chunk_digests"))
    return doc


async def image_build(a: argparse.Namespace) -> int:
    from corral.images import build

    store = _store(a)
    if a.run:
        return await _image_run(a)
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
    _emit(
        a,
        _layer_doc(layer),
        f"{a.ref} {layer.digest} "
        f"({format_size(layer.content_size)} content, {format_size(layer.meta_size)} metadata)",
    )
    return 0


async def _image_run(a: argparse.Namespace) -> int:
    """`image build --run BASE -- CMD`: what CMD changes becomes the layer."""
    cmd = _cmd(a.cmd)
    async with _client(a) as client:
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
    _emit(a, layer.model_dump(), f"{a.ref} {layer.digest} ({format_size(layer.content_size)})")
    return 0


async def image_push(a: argparse.Namespace) -> int:
    from corral.images import registry
    from corral.images.objects import open_store

    remote = open_store(a.store)
    with progress_bar(disable=a.json) as progress:
        layer = await asyncio.to_thread(registry.push, _store(a), a.ref, remote, progress)
    _emit(a, _layer_doc(layer), f"pushed {a.ref} {layer.digest[:19]} to {a.store}")
    return 0


async def image_pull(a: argparse.Namespace) -> int:
    from corral.images import registry
    from corral.images.objects import open_store

    remote = open_store(a.store)
    with progress_bar(disable=a.json) as progress:
        layer = await asyncio.to_thread(
            registry.pull, _store(a), a.ref, remote, progress, eager=a.eager
        )
    _emit(
        a,
        _layer_doc(layer),
        f"pulled {a.ref} {layer.digest[:19]} from {a.store} (its data loads on first read)",
    )
    return 0


async def image_gc(a: argparse.Namespace) -> int:
    from corral.node.store import ACTIVE_STATES, Store

    cfg = _config(a)
    in_use: set[str] = set()
    if cfg.db_path.exists():
        db = Store(cfg.db_path)
        in_use = {d for r in db.list(ACTIVE_STATES) for d in r.layers}
        db.close()
    removed, freed = _store(a).gc(in_use)
    _emit(
        a,
        {"layers_removed": removed, "bytes_freed": freed},
        f"removed {removed} layers, freed {format_size(freed)}",
    )
    return 0


async def blobd(a: argparse.Namespace) -> int:
    import uvicorn

    from corral.images.blobd import create_blob_app
    from corral.units import parse_size

    rate = parse_size(a.rate, "rate") if a.rate else None
    app = create_blob_app(a.root, rate=rate, api_key=a.api_key)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=a.host, port=a.port, log_level="warning", access_log=False, lifespan="off"
        )
    )
    await server.serve()
    return 0


async def image_import(a: argparse.Namespace) -> int:
    from corral.images import build

    store = _store(a)
    with progress_bar(disable=a.json) as progress:
        layer = await asyncio.to_thread(
            build.build_from_tar, store, a.tarball, tag=a.ref, kind=a.kind, progress=progress
        )
    _emit(a, _layer_doc(layer), f"{a.ref} {layer.digest}")
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
    _emit(a, [_layer_doc(layer) for layer in layers], table)
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
