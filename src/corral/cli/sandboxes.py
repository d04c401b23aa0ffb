"""`corral create/run/exec/ls/rm/call/screenshot/view/suspend/resume`: sandboxes,
through the SDK client (embedded or --url)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from rich.table import Table

from corral.cli.args import create_kwargs, given_command, open_client, parse_labels
from corral.cli.output import emit
from corral.errors import InvalidArgument
from corral.sdk.sandbox import AsyncSandbox
from corral.units import format_size


async def create(a: argparse.Namespace) -> int:
    async with open_client(a) as client:
        sbx = await client.sandboxes.create(**create_kwargs(a))
        emit(a, sbx.info.model_dump(mode="json"), sbx.id)
    return 0


async def _run_in(sbx: AsyncSandbox, a: argparse.Namespace, cmd: str | list[str]) -> int:
    """Runs `cmd`, streaming its output (or one JSON result with --json);
    the exit status is the command's, or 128 + its signal like a shell's."""

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
    from corral.runtimes.vm.pixels import png_size

    async with open_client(a) as client:
        sbx = await client.sandboxes.get(a.id)
        png = await sbx.display.screenshot()
    out = a.output or Path(f"{a.id}.png")
    out.write_bytes(png)
    w, h = png_size(png)
    emit(a, {"path": str(out), "width": w, "height": h, "bytes": len(png)}, f"{out} {w}x{h}")
    return 0


async def view(a: argparse.Namespace) -> int:
    async with open_client(a) as client:
        sbx = await client.sandboxes.get(a.id)
        access = await sbx.display.view(interactive=a.interactive, ttl=a.ttl)
    emit(a, access.model_dump(mode="json"), access.url or access.path)
    return 0


async def suspend(a: argparse.Namespace) -> int:
    async with open_client(a) as client:
        info = await (await client.sandboxes.get(a.id)).suspend()
    emit(a, info.model_dump(mode="json"), f"{info.id} {info.state.value}")
    return 0


async def resume(a: argparse.Namespace) -> int:
    async with open_client(a) as client:
        info = await (await client.sandboxes.get(a.id)).resume()
    emit(a, info.model_dump(mode="json"), f"{info.id} {info.state.value}")
    return 0


async def exec_(a: argparse.Namespace) -> int:
    async with open_client(a) as client:
        sbx = await client.sandboxes.get(a.id)
        return await _run_in(sbx, a, given_command(a.cmd))


async def run(a: argparse.Namespace) -> int:
    async with open_client(a) as client:
        sbx = await client.sandboxes.create(**create_kwargs(a))
        try:
            return await _run_in(sbx, a, given_command(a.cmd))
        finally:
            await sbx.close()


async def call(a: argparse.Namespace) -> int:
    def read(path: Path, what: str) -> bytes:
        try:
            return path.read_bytes()
        except OSError as exc:
            raise InvalidArgument(
                what, f"must be a readable file ({exc.strerror})", str(path)
            ) from None

    source = sys.stdin.read() if a.source == "-" else read(Path(a.source), "source").decode()
    async with open_client(a) as client:
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
    async with open_client(a) as client:
        boxes = await client.sandboxes.list(parse_labels(a.label) or None)
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
    emit(a, [s.info.model_dump(mode="json") for s in boxes], table)
    return 0


async def rm(a: argparse.Namespace) -> int:
    async with open_client(a) as client:
        for sid in a.ids:
            sbx = await client.sandboxes.get(sid)
            await sbx.close()
            if not a.json:
                print(sid)
    return 0
