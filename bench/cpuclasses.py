"""DSec's CPU-class experiment, repeated: a latency-critical agent step
measured alone, then with background sandboxes loading the node to about
50%, with the classes off (every sandbox weighed alike) and on (the load
in `background` sandboxes: an idle cgroup, SCHED_IDLE, cores of its own).

    python bench/cpuclasses.py [--n 40] [--quick]

Two steps an agent waits on, each an exec round trip from the SDK:
- compile: gcc -O2 of a 150-line C file (fncall:bookworm);
- test: pytest on a small test file (debian-python + the pytest toolkit).

The load: 4 sandboxes each running a duty-cycled loop (busy 10 ms, asleep
15 ms), spread over both cores, as a test suite or a build does; the CPU
the loaders get is measured from their cgroups (about one core, 50% of the
node, with classes off). Modes alternate in blocks, so drift falls on all alike.
DSec reports latency inflation 45.2% without classes and 17.3% with.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import corral  # noqa: E402
from _common import IMAGE, IMAGES, fresh_dir, pct, table, write_result  # noqa: E402
from corral.config import NodeConfig  # noqa: E402
from corral.node.agent import NodeAgent  # noqa: E402

WORK = Path("/var/lib/corral-bench-cpuclasses")
BLOCK = 5
MODES = ("alone", "loaded, classes off", "loaded, classes on", "loaded, classes on, not confined")
LOADERS = 4
LOAD = (
    "python3 -c 'import time\n"
    "while True:\n"
    "    t = time.perf_counter()\n"
    "    while time.perf_counter() - t < 0.010: pass\n"
    "    time.sleep(0.015)'"
)
C_SOURCE = "\n".join(
    ["#include <stdio.h>", "#include <string.h>"]
    + [
        f"static int f{i}(const char *s, int n) {{ int h = {i}; "
        f"for (int k = 0; k < n; k++) h = h * 31 + s[k] * {i + 1}; return h ^ (int)strlen(s); }}"
        for i in range(150)
    ]
    + ["int main(void) { int t = 0;"]
    + [f'  t += f{i}("corral", 6);' for i in range(150)]
    + ['  printf("%d\\n", t); return 0; }']
)
TEST_SOURCE = """
import json, re

def parse(s):
    return [int(x) for x in re.findall(r"-?\\d+", s)]

def test_parse():
    assert parse("a1 b-2 c33") == [1, -2, 33]

def test_roundtrip():
    data = {"k": list(range(100))}
    assert json.loads(json.dumps(data)) == data

def test_sort():
    assert sorted(parse("3 1 2")) == [1, 2, 3]
"""
STEPS = {
    "compile (gcc -O2, 150 functions)": "gcc -O2 -c /tmp/m.c -o /tmp/m.o",
    "test (pytest, 3 tests)": "python3 -m pytest -q -p no:cacheprovider /tmp/test_s.py",
}


async def _run(n: int) -> tuple[dict[tuple[str, str], list[float]], dict[str, float]]:
    cfg = NodeConfig.from_env(data_dir=WORK, images=IMAGES, node="cpu", scratch_size=4 * 2**30)
    fresh_dir(cfg.data_dir)
    out: dict[tuple[str, str], list[float]] = {(s, m): [] for s in STEPS for m in MODES}
    load: dict[str, list[float]] = {m: [] for m in MODES}
    async with corral.AsyncClient(config=cfg) as client:
        agent = client.service
        assert isinstance(agent, NodeAgent)
        cgroups = agent.parts.cgroups

        def used(boxes: list[corral.AsyncSandbox]) -> float:
            return sum(cgroups.cpu_seconds(b.id) or 0.0 for b in boxes)

        cc = await client.sandboxes.create(image="fncall:bookworm", memory="512MiB")
        await cc.files.write("/tmp/m.c", C_SOURCE.encode())
        py = await client.sandboxes.create(image=IMAGE, toolkit="pytest:8.3.3", memory="512MiB")
        await py.files.write("/tmp/test_s.py", TEST_SOURCE.encode())
        boxes = {"compile": cc, "test": py}
        loaders = {
            cls: [
                await client.sandboxes.create(image=IMAGE, memory="128MiB", cpu_class=cls)
                for _ in range(LOADERS)
            ]
            for cls in ("interactive", "background")
        }
        for step, cmd in STEPS.items():  # warm: layers read, caches filled
            for _ in range(3):
                r = await boxes[step.split()[0]].commands.run(cmd, timeout=120)
                assert r.exit_code == 0, (step, r.stdout, r.stderr)

        async def block(mode: str) -> None:
            handles, busy = [], []
            agent.parts.cpu.confine = not mode.endswith("not confined")
            agent.parts.cpu._cached = None  # the partition is read again, with that
            if mode != "alone":
                busy = loaders["interactive" if mode.endswith("off") else "background"]
                handles = [await s.commands.start(LOAD) for s in busy]
                await asyncio.sleep(1.5)  # the load settles; the node moves its cores
            c0, w0 = used(busy), time.monotonic()
            for step, cmd in STEPS.items():
                for _ in range(BLOCK):
                    start = time.perf_counter()
                    r = await boxes[step.split()[0]].commands.run(cmd, timeout=120)
                    out[(step, mode)].append(time.perf_counter() - start)
                    assert r.exit_code == 0, (step, r.stderr)
            load[mode].append((used(busy) - c0) / (time.monotonic() - w0) / (os.cpu_count() or 1))
            for h in handles:
                await h.kill()
                await h.wait()

        while min(len(v) for v in out.values()) < n:
            for mode in MODES:
                await block(mode)
                print(f"{mode}: {len(out[(next(iter(STEPS)), mode)])}/{n}", file=sys.stderr)
        for s in [cc, py, *loaders["interactive"], *loaders["background"]]:
            await s.close()
    return out, {m: sum(v) / len(v) for m, v in load.items()}


HEADER = ["step", "mode", "load", "n", "p50 (ms)", "p99 (ms)", "p50 inflation", "p99 inflation"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=40)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    n = 10 if a.quick else a.n
    out, load = asyncio.run(_run(n))
    rows = []
    for step in STEPS:
        alone = {q: pct([x * 1000 for x in out[(step, "alone")]], q) for q in (50, 99)}
        for mode in MODES:
            ms = [x * 1000 for x in out[(step, mode)]]
            p50, p99 = pct(ms, 50), pct(ms, 99)
            rows.append([
                step, mode, f"{load[mode] * 100:.0f}%", str(len(ms)), f"{p50:.1f}",
                f"{p99:.1f}", f"{(p50 / alone[50] - 1) * 100:+.1f}%",
                f"{(p99 / alone[99] - 1) * 100:+.1f}%",
            ])  # fmt: skip
    sections = [
        "One embedded node (SDK in this process). The step's sandbox is interactive; "
        f"the load is {LOADERS} sandboxes each running a loop busy 10 ms of every 25 ms "
        "(nominally 1.6 cores), started at the beginning of each block and killed "
        "at its end; `classes off`: the loaders are `interactive` sandboxes (weighed like "
        "the step's, every core shared); `classes on`: they are `background` ones (idle "
        "cgroup, SCHED_IDLE, and while busy the node keeps them on the last core and the "
        "step's sandbox on the other); `not confined`: the same, but the step's sandbox may "
        "use both cores, preempting them on theirs (cpu_confine_interactive off). "
        f"Blocks of {BLOCK} runs per step, modes alternating. "
        "`load` is the CPU the loaders got during the block, as a share of the node "
        "(their cgroups' usage).",
        table(HEADER, rows),
        "DSec: inflation 45.2% without classes, 17.3% with, at 50% background load. "
        "Target (issue 20): at most 10% with classes on this 2-core machine.",
    ]
    write_result("cpuclasses", "CPU classes: an agent's step under background load", sections)


if __name__ == "__main__":
    main()
