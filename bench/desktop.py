"""Desktop sandboxes as a computer-use agent uses them: create to drawn,
screenshot latency, action round trips, window list, host memory per idle
desktop. The peer is bare QEMU: the same VM's QMP socket driven directly
(screendump, input-send-event), which is the floor any API over QEMU has.

    corral bench desktop [--creates 5] [--n 40] [--idle 2] [--image REF --toolkit REF]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corral
from _common import IMAGES, fresh_dir, leak_counts, mem_used, pct, table, timed, write_result
from corral.config import NodeConfig
from corral.runtimes.vm import desktop
from corral.runtimes.vm.qemu import accelerator
from corral.runtimes.vm.qmp import Qmp

WORK = Path("/var/lib/corral-desktop")
SIZE = "1280x800"


class Phases(logging.Handler):
    """The node's own phase timings of each create (its sandbox.created log)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seen: list[dict[str, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", {})
        if record.getMessage() == "sandbox.created" and "drawn" in fields:
            self.seen.append(fields)


def ms(values: list[float]) -> list[str]:
    return [f"{pct(values, 50) * 1000:.1f}", f"{pct(values, 99) * 1000:.1f}"]


async def bare_shot(sock: Path, path: Path) -> None:
    qmp = await Qmp.connect(sock, timeout=10)
    try:
        await qmp.execute("screendump", filename=str(path), format="png")
    finally:
        qmp.close()
    path.read_bytes()


async def bare_move(sock: Path) -> None:
    qmp = await Qmp.connect(sock, timeout=10)
    try:
        events = [
            {"type": "abs", "data": {"axis": "x", "value": 1000}},
            {"type": "abs", "data": {"axis": "y", "value": 1000}},
        ]
        await qmp.execute("input-send-event", events=events)
    finally:
        qmp.close()


async def main(a: argparse.Namespace) -> None:
    fresh_dir(WORK)
    before = leak_counts(WORK)
    # Booted every time: the parts of a boot are what this table shows
    # (creates from a spec's template: bench/desktop_kinds.py).
    cfg = NodeConfig.from_env(data_dir=WORK, images=IMAGES, node="desk", vm_templates=0)
    phases = Phases()
    logging.getLogger("corral").addHandler(phases)
    logging.getLogger("corral").setLevel(logging.INFO)
    spec = {
        "kind": "fullvm", "image": a.image, "toolkit": [a.toolkit], "memory": "1GiB",
        "display_size": SIZE,
    }  # fmt: skip
    async with corral.AsyncClient(config=cfg) as c:
        await (await c.sandboxes.create(**spec)).close()  # guest artefacts, pmem image
        phases.seen.clear()
        create_t = []
        for _ in range(a.creates):
            t0 = time.perf_counter()
            s = await c.sandboxes.create(**spec)
            create_t.append(time.perf_counter() - t0)
            await s.close()
            print(f"create {create_t[-1]:.1f}s", flush=True)
        ready = [p["ready"] / 1000 + p["start"] / 1000 + p["prepare"] / 1000 for p in phases.seen]
        drawn = [p["drawn"] / 1000 for p in phases.seen]

        s = await c.sandboxes.create(**spec)
        d = s.display
        sock = cfg.sandboxes_dir / s.id / "qmp.sock"
        shot = WORK / "bare.png"
        n = a.n
        shots = {
            "Corral, whole screen (PNG by QEMU)": await timed(n, d.screenshot),
            "Corral, 50% scaled": await timed(n, lambda: d.screenshot(scale=0.5)),
            "Corral, region 400x300": await timed(
                n, lambda: d.screenshot(region=(100, 100, 400, 300))
            ),
            "bare QMP screendump (PNG)": await timed(n, lambda: bare_shot(sock, shot)),
        }
        bare_p50 = pct(shots["bare QMP screendump (PNG)"], 50)
        shot_rows = [[name, *ms(t), f"{pct(t, 50) / bare_p50:.2f}x"] for name, t in shots.items()]
        print(shot_rows, flush=True)
        actions = {
            "move": await timed(n, lambda: d.move(640, 400)),
            "click": await timed(n, lambda: d.click(1200, 700)),
            "key (ctrl+shift)": await timed(n, lambda: d.key("ctrl+shift")),
            "type 10 characters": await timed(n, lambda: d.type("abcdefghij")),
            "scroll 1 notch": await timed(n, lambda: d.scroll(1)),
            "cursor()": await timed(n, d.cursor),
            "windows()": await timed(max(5, n // 4), d.windows),
            "bare QMP move": await timed(n, lambda: bare_move(sock)),
        }
        action_rows = [[name, *ms(t)] for name, t in actions.items()]
        print(action_rows, flush=True)
        await s.close()

        before_mem = mem_used()
        idle = [await c.sandboxes.create(**spec) for _ in range(a.idle)]
        await asyncio.sleep(20)
        per_idle = (mem_used() - before_mem) / a.idle / 2**20
        pss = 0
        for b in idle:
            pid = int((cfg.sandboxes_dir / b.id / "qemu.pid").read_text().split()[0])
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1]) * 1024
        for b in idle:
            await b.close()
    after = leak_counts(WORK)
    create_rows = [
        [name, str(len(t)), f"{pct(t, 50):.2f}", f"{pct(t, 99):.2f}"]
        for name, t in (
            ("create to drawn (all)", create_t),
            ("of it: to agent", ready),
            ("of it: agent to drawn", drawn),
        )
    ]
    sections = [
        f"## Create to drawn (accelerator: {accelerator()})\n\n"
        f"`{a.image}` + `{a.toolkit}`, {SIZE}, 1 GiB, sequential, booted each time "
        "(`vm_templates = 0`; from a template: desktop-kinds.md). Ready means drawn: create "
        "returns when the session has mapped its first window and QEMU's framebuffer shows it "
        "(docs/display.md). `agent` is create until the guest's agent answered (layers, QEMU, "
        "boot); `drawn` the wait after it for the desktop.\n\n"
        + table(["part", "creates", "p50 (s)", "p99 (s)"], create_rows)
        + "\n\nTarget (issue 21, TCG): <= 5 s.",
        f"## Screenshot ({SIZE}, {n} each)\n\n"
        + table(["screenshot", "p50 (ms)", "p99 (ms)", "p50 vs bare"], shot_rows)
        + "\n\nTarget (issue 21): <= 50 ms at 1280x800.",
        f"## Action round trip ({n} each; windows() {max(5, n // 4)})\n\n"
        "From the SDK call to QEMU having taken the events (embedded client).\n\n"
        + table(["action", "p50 (ms)", "p99 (ms)"], action_rows),
        f"## Host memory per idle desktop ({a.idle} held, 20 s after drawn)\n\n"
        + table(
            ["MemAvailable drop per desktop (MiB)", "QEMU PSS per desktop (MiB)"],
            [[f"{per_idle:.0f}", f"{pss / a.idle / 2**20:.0f}"]],
        ),
        "## Leftovers\n\n"
        + table(
            ["object", "before", "after"], [[k, str(before[k]), str(after[k])] for k in before]
        ),
    ]
    name = "desktop" if a.image == desktop.BASE else "desktop-xfce"
    title = f"Desktop sandboxes ({a.image}): create to drawn, screenshots, actions"
    print(write_result(name, title, sections))
    print(json.dumps({"create_p50": pct(create_t, 50)}))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--creates", type=int, default=5)
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--idle", type=int, default=2)
    ap.add_argument("--image", default=desktop.BASE)
    ap.add_argument("--toolkit", default=desktop.TOOLKIT)
    asyncio.run(main(ap.parse_args()))
