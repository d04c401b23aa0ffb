"""How much of the XFCE desktop image a session reads (it is loaded lazily,
chunk by chunk, like every image): a container desktop and a full VM's,
each on a fresh node (an empty chunk cache), measured when the desktop is
drawn and again after the session opened Chromium and LibreOffice Calc.

"Read" is what the node's lazy loader handed the kernel for each layer
(its served_bytes): a page read twice is served once while the kernel
keeps it. The full VM runs with vm_pmem off here: a pmem base is built
by reading the base layer whole once per node (one shared copy for every
VM instead of lazy reads), which would read as 100%.

    corral bench desktop_reads
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corral
from _common import IMAGES, fresh_dir, table, write_result
from corral.config import NodeConfig
from corral.images.store import ImageStore
from corral.runtimes.vm import xfce

WORK = Path("/var/lib/corral-desktop-reads")
APPS = (("chromium", "Chromium"), ("libreoffice-calc", "LibreOffice"))
MB = 2**20


def served(cfg: NodeConfig) -> dict[str, dict[str, int]]:
    doc = json.loads((cfg.data_dir / "lazy" / "fs" / ".stats").read_bytes())
    return doc["layers"]  # type: ignore[no-any-return]


async def open_apps(s: corral.AsyncSandbox) -> None:
    for app, title in APPS:
        await s.display.launch(app)
        deadline = time.monotonic() + 300
        while not any(title in w.title for w in await s.display.windows()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{app}'s window never appeared")
            await asyncio.sleep(1)
        await asyncio.sleep(5)  # its first screen drawn, its start-up reads done


async def session(kind: str) -> dict[str, Any]:
    cfg = NodeConfig.from_env(
        data_dir=fresh_dir(WORK / kind), images=IMAGES, node=f"r{kind[:4]}", vm_pmem=False,
        vm_templates=0,
    )  # fmt: skip
    async with corral.AsyncClient(config=cfg) as c:
        t0 = time.perf_counter()
        s = await c.sandboxes.create(
            kind=kind, image=xfce.BASE, toolkit=[xfce.TOOLKIT], memory="2GiB",
            display_size="1280x800",
        )  # fmt: skip
        try:
            drawn_s = time.perf_counter() - t0
            at_drawn = served(cfg)
            await open_apps(s)
            after = served(cfg)
        finally:
            await s.close()
    print(f"{kind}: drawn in {drawn_s:.1f}s", flush=True)
    return {"drawn": at_drawn, "apps": after}


async def main(a: argparse.Namespace) -> None:
    store = ImageStore(IMAGES)
    names = {}
    for ref in (xfce.BASE, xfce.TOOLKIT):
        for layer in store.chain(store.resolve(ref)):
            names[layer.digest] = f"{ref} ({layer.digest[7:19]})"
    got = {kind: await session(kind) for kind in ("container", "fullvm")}
    rows = []
    for digest, name in names.items():
        size = got["container"]["apps"].get(digest, {}).get("blob_size", 0)
        row = [name, f"{size / MB:.0f}"]
        for kind in ("container", "fullvm"):
            for moment in ("drawn", "apps"):
                n = got[kind][moment].get(digest, {}).get("served_bytes", 0)
                row.append(f"{n / MB:.0f} ({100 * n / size:.1f}%)" if size else "-")
        rows.append(row)
    total = sum(got["container"]["apps"].get(d, {}).get("blob_size", 0) for d in names)
    sums = ["**the image**", f"**{total / MB:.0f}**"]
    for kind in ("container", "fullvm"):
        for moment in ("drawn", "apps"):
            n = sum(got[kind][moment].get(d, {}).get("served_bytes", 0) for d in names)
            sums.append(f"**{n / MB:.0f} ({100 * n / total:.1f}%)**")
    rows.append(sums)
    section = (
        "## Read of the XFCE image (MiB of each layer's data, and its share)\n\n"
        "Fresh node per kind (empty chunk cache, full VM without pmem). `drawn`: when create "
        "returned; `+ apps`: after Chromium and LibreOffice Calc each opened a window.\n\n"
        + table(
            ["layer", "data MiB", "container: drawn", "+ apps", "full VM: drawn", "+ apps"],
            rows,
        )
    )
    print(write_result("desktop-reads", "How much of the XFCE image a session reads", [section]))


if __name__ == "__main__":
    asyncio.run(main(argparse.ArgumentParser().parse_args()))
