"""`corral disk ...`: add, list and remove users' own VM disks on this
host (images/disks.py), booted as `image="disk:NAME"` on kind fullvm."""

from __future__ import annotations

import argparse
import asyncio

from rich.table import Table

from corral.cli.args import node_config
from corral.cli.output import emit
from corral.images.disks import Disks
from corral.progress import progress_bar
from corral.units import format_size


def _disks(a: argparse.Namespace) -> Disks:
    return Disks(node_config(a).disks_dir)


async def disk_add(a: argparse.Namespace) -> int:
    name = a.name or a.path.name
    if a.project is not None:
        # One project's own: only it boots it through a gateway.
        name = f"projects/{a.project}/{name}"
    with progress_bar(disable=a.json) as progress:
        disk = await asyncio.to_thread(
            _disks(a).add, a.path, name, lambda done, total: progress("copy", done, total)
        )
    if a.json:
        emit(a, disk.to_json(), None)
    else:
        print(f"added disk:{disk.name} ({disk.format}, {format_size(disk.virtual_size)})")
    return 0


async def disk_ls(a: argparse.Namespace) -> int:
    disks = _disks(a).list()
    table = Table("IMAGE", "FORMAT", "VIRTUAL SIZE", "ON DISK")
    for d in disks:
        table.add_row(
            f"disk:{d.name}", d.format, format_size(d.virtual_size), format_size(d.file_size)
        )
    emit(a, [d.to_json() for d in disks], table)
    return 0


async def disk_rm(a: argparse.Namespace) -> int:
    for name in a.names:
        _disks(a).remove(name)
        if not a.json:
            print(f"removed disk:{name.removeprefix('disk:')}")
    return 0
