"""A container desktop (Xvfb in the sandbox) next to a full VM's (QEMU),
in one run, on the same image: create to drawn, screenshot and action
round trips, host memory per idle desktop. Each kind also has its floor
measured beside it: for the VM, QEMU's QMP socket driven directly; for the
container, the sandbox's agent asked directly (the screen file read raw,
xdotool run by the agent) with no Corral API in between.

    corral bench desktop_kinds [--creates 5] [--n 40] [--idle 3] [--xfce]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corral
from _common import IMAGES, fresh_dir, leak_counts, mem_used, pct, table, timed, write_result
from corral.config import NodeConfig
from corral.execd import protocol as p
from corral.execd.client import ExecdClient
from corral.host.cgroups import Cgroups
from corral.node.lifecycle import control_path
from corral.runtimes.container import xscreen
from corral.runtimes.vm import desktop, xfce
from corral.runtimes.vm.qemu import accelerator
from desktop import Phases, bare_move, bare_shot

WORK = Path("/var/lib/corral-desktop")
SIZE = "1280x800"
KINDS = ("container", "fullvm")


async def agent_xdotool(client: ExecdClient, *argv: str) -> None:
    session = await client.start(
        ["xdotool", *argv], xscreen.ENV, user="root", cwd="/", timeout=10,
        stdout_cap=4096, stderr_cap=4096, stdin=None,
    )  # fmt: skip
    async for kind, data in session.events():
        if kind == p.RSP_EXIT and p.parse_exit(data).exit_code != 0:
            raise RuntimeError("xdotool failed")


def pss(pid: int) -> int:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0  # gone meanwhile
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def container_memory(cfg: NodeConfig, sandbox_id: str) -> tuple[int, int]:
    """A container desktop's (PSS of its processes, its memory cgroup's
    charge: processes, page cache, tmpfs)."""
    pids: set[int] = set()
    charge = 0
    for d in Cgroups(cfg.cgroup_parent).dirs(sandbox_id):
        if (d / "cgroup.procs").exists():
            pids |= {int(x) for x in (d / "cgroup.procs").read_text().split()}
        for name in ("memory.current", "memory.usage_in_bytes"):
            if (d / name).exists():
                charge = int((d / name).read_text())
    return sum(pss(pid) for pid in pids), charge


def qemu_pss(cfg: NodeConfig, sandbox_id: str) -> int:
    return pss(int((cfg.sandboxes_dir / sandbox_id / "qemu.pid").read_text().split()[0]))


async def measure(
    c: corral.AsyncClient, cfg: NodeConfig, phases: Phases, kind: str, a: argparse.Namespace
) -> dict[str, Any]:
    image, toolkit = (xfce.BASE, xfce.TOOLKIT) if a.xfce else (desktop.BASE, desktop.TOOLKIT)
    spec: dict[str, Any] = {
        "kind": kind, "image": image, "toolkit": [toolkit],
        "memory": "2GiB" if a.xfce else "1GiB", "display_size": SIZE,
    }  # fmt: skip
    await (await c.sandboxes.create(**spec)).close()  # caches, a VM's pmem image
    phases.seen.clear()
    creates = []
    for _ in range(a.creates):
        t0 = time.perf_counter()
        s = await c.sandboxes.create(**spec)
        creates.append(time.perf_counter() - t0)
        await s.close()
        print(f"{kind} create {creates[-1]:.2f}s", flush=True)
    drawn = [ph["drawn"] / 1000 for ph in phases.seen]

    s = await c.sandboxes.create(**spec)
    d, n = s.display, a.n
    out: dict[str, Any] = {"create": creates, "drawn": drawn}
    out["shot"] = await timed(n, d.screenshot)
    out["shot50"] = await timed(n, lambda: d.screenshot(scale=0.5))
    out["region"] = await timed(n, lambda: d.screenshot(region=(100, 100, 400, 300)))
    out["move"] = await timed(n, lambda: d.move(640, 400))
    out["click"] = await timed(n, lambda: d.click(1200, 700))
    out["key"] = await timed(n, lambda: d.key("ctrl+shift"))
    out["type10"] = await timed(n, lambda: d.type("abcdefghij"))
    out["cursor"] = await timed(n, d.cursor)
    if kind == "fullvm":
        sock = cfg.sandboxes_dir / s.id / "qmp.sock"
        out["bare_shot"] = await timed(n, lambda: bare_shot(sock, WORK / "bare.png"))
        out["bare_move"] = await timed(n, lambda: bare_move(sock))
    else:
        agent = ExecdClient(str(control_path(cfg.run_dir, s.id)))
        out["bare_shot"] = await timed(
            n, lambda: agent.read("root", xscreen.FB_PATH, xscreen.FB_MAX, nofollow=True)
        )
        out["bare_move"] = await timed(n, lambda: agent_xdotool(agent, "mousemove", "640", "400"))
    await s.close()

    before = mem_used()
    idle = [await c.sandboxes.create(**spec) for _ in range(a.idle)]
    await asyncio.sleep(20)
    out["mem"] = (mem_used() - before) / a.idle
    if kind == "fullvm":
        out["own"] = sum(qemu_pss(cfg, b.id) for b in idle) / a.idle
        out["charge"] = 0.0
    else:
        own = [container_memory(cfg, b.id) for b in idle]
        out["own"] = sum(o[0] for o in own) / a.idle
        out["charge"] = sum(o[1] for o in own) / a.idle
    for b in idle:
        await b.close()
    return out


async def boots(c: corral.AsyncClient, phases: Phases, a: argparse.Namespace) -> dict[str, Any]:
    image, toolkit = (xfce.BASE, xfce.TOOLKIT) if a.xfce else (desktop.BASE, desktop.TOOLKIT)
    spec: dict[str, Any] = {
        "kind": "fullvm", "image": image, "toolkit": [toolkit],
        "memory": "2GiB" if a.xfce else "1GiB", "display_size": SIZE,
    }  # fmt: skip
    phases.seen.clear()
    creates = []
    for _ in range(a.creates):
        t0 = time.perf_counter()
        await (await c.sandboxes.create(**spec)).close()
        creates.append(time.perf_counter() - t0)
        print(f"fullvm booted {creates[-1]:.2f}s", flush=True)
    return {"create": creates, "drawn": [ph["drawn"] / 1000 for ph in phases.seen]}


async def main(a: argparse.Namespace) -> None:
    fresh_dir(WORK)
    before = leak_counts(WORK)
    cfg = NodeConfig.from_env(data_dir=WORK, images=IMAGES, node="desk")
    phases = Phases()
    logging.getLogger("corral").addHandler(phases)
    logging.getLogger("corral").setLevel(logging.INFO)
    async with corral.AsyncClient(config=cfg) as c:
        got = {kind: await measure(c, cfg, phases, kind, a) for kind in KINDS}
    # The same full VM booted every time (no template: node/templates.py).
    booted_cfg = replace(cfg, data_dir=WORK / "booted", node="desk0", vm_templates=0)
    async with corral.AsyncClient(config=booted_cfg) as c:
        booted = await boots(c, phases, a)
    after = leak_counts(WORK)
    con, vm = got["container"], got["fullvm"]

    def row(name: str, key: str, unit: float = 1000.0) -> list[str]:
        cells = [name]
        for r in (con, vm):
            cells += [f"{pct(r[key], 50) * unit:.1f}", f"{pct(r[key], 99) * unit:.1f}"]
        return [*cells, f"{pct(con[key], 50) / pct(vm[key], 50):.2f}x"]

    head = ["", "container p50", "p99", "full VM p50", "p99", "container / VM"]
    image = (
        f"`{xfce.BASE}` + `{xfce.TOOLKIT}`" if a.xfce else f"`{desktop.BASE}` + `{desktop.TOOLKIT}`"
    )
    sections = [
        f"## Create to drawn (s; {a.creates} sequential creates each; VM accelerator: "
        f"{accelerator()})\n\n{image}, {SIZE}. Ready means drawn for both (docs/display.md): "
        "create returns when the session has mapped its first window and the screen shows it; "
        "`drawn` is the part after the sandbox's agent first answered.\n\n"
        + table(head, [row("create to drawn", "create", 1.0)])
        + "\n\nThe full VM loads its spec's template (docs/vm.md: the first create of a spec "
        "boots and leaves its drawn desktop; this run's first create, not counted, did). "
        "Booted every time instead (`vm_templates = 0`), and how much of that is waiting "
        "for the desktop after the agent answered:\n\n"
        + table(
            ["full VM, booted", "p50", "p99", "booted / from template"],
            [
                [
                    "create to drawn",
                    f"{pct(booted['create'], 50):.2f}",
                    f"{pct(booted['create'], 99):.2f}",
                    f"{pct(booted['create'], 50) / pct(vm['create'], 50):.1f}x",
                ],
                [
                    "of it: drawn",
                    f"{pct(booted['drawn'], 50):.2f}",
                    f"{pct(booted['drawn'], 99):.2f}",
                    "",
                ],
            ],
        )
        + "\n\nTargets (issue 21, TCG): container <= 1 s, full VM <= 5 s.",
        f"## Screenshots and actions (ms, {a.n} each)\n\n"
        "Floors beside each kind: the VM's is QMP driven directly (screendump, one "
        "input-send-event); the container's is its agent asked directly (the Xvfb screen file "
        "read raw; `xdotool mousemove` run by the agent).\n\n"
        + table(
            head,
            [
                row("screenshot, whole", "shot"),
                row("screenshot, 50% scaled", "shot50"),
                row("screenshot, region 400x300", "region"),
                row("floor: raw screen read", "bare_shot"),
                row("move", "move"),
                row("click", "click"),
                row("key (ctrl+shift)", "key"),
                row("type 10 characters", "type10"),
                row("cursor()", "cursor"),
                row("floor: one move, no API", "bare_move"),
            ],
        ),
        f"## Host memory per idle desktop (MiB; {a.idle} held, 20 s after drawn)\n\n"
        "The MemAvailable drop is the host's view, noisy at tens of MiB (page cache comes "
        "and goes); PSS shares the pages the desktops have in common among them.\n\n"
        + table(
            ["", "container", "full VM", "container / VM"],
            [
                [
                    "MemAvailable drop per desktop",
                    f"{con['mem'] / 2**20:.0f}",
                    f"{vm['mem'] / 2**20:.0f}",
                    f"{con['mem'] / vm['mem']:.2f}x",
                ],
                [
                    "PSS of its processes (container: all of them; VM: QEMU)",
                    f"{con['own'] / 2**20:.0f}",
                    f"{vm['own'] / 2**20:.0f}",
                    f"{con['own'] / vm['own']:.2f}x",
                ],
                [
                    "container: its memory cgroup's charge (with page cache, /tmp)",
                    f"{con['charge'] / 2**20:.0f}",
                    "",
                    "",
                ],
            ],
        ),
        "## Leftovers\n\n"
        + table(
            ["object", "before", "after"], [[k, str(before[k]), str(after[k])] for k in before]
        ),
    ]
    name = "desktop-kinds-xfce" if a.xfce else "desktop-kinds"
    title = "Desktop sandboxes: a container's (Xvfb) next to a full VM's (QEMU)"
    print(write_result(name, title, sections))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--creates", type=int, default=5)
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--idle", type=int, default=3)
    ap.add_argument("--xfce", action="store_true", help="the XFCE desktop, not twm")
    asyncio.run(main(ap.parse_args()))
