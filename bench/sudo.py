"""What the platform's sudo costs (docs/sudo.md).

    corral bench sudo [--n 200]

In one sandbox of E2B's base template (debian-python + e2b-user, whose user
may sudo), side by side and interleaved: a command run through the exec
API as the user, the same under `sudo`, and the same as root (what a
caller without sudo did instead); then, inside the sandbox, a program
starting `true` and `sudo true` one after another (sudo's own cost, with
no API round trip).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corral
from _common import IMAGE, median, pct, table, write_result

TOOLKIT = "e2b-user:bookworm"
INSIDE = """
import json, subprocess, time
out = {}
for name, argv in (("true", ["true"]), ("sudo true", ["sudo", "true"])):
    times = []
    for _ in range(N):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True)
        times.append(time.perf_counter() - t0)
    out[name] = times
print(json.dumps(out))
"""


def row(name: str, times: list[float], base: list[float]) -> list[str]:
    return [
        name,
        f"{median(times) * 1000:.2f}",
        f"{pct(times, 99) * 1000:.2f}",
        f"{median(times) / median(base):.2f}x",
    ]


async def main(n: int) -> None:
    async with corral.AsyncClient() as client:
        sbx = await client.sandboxes.create(image=IMAGE, toolkit=[TOOLKIT], memory="256MiB")
        try:
            api: dict[str, list[float]] = {"user": [], "sudo": [], "root": []}
            calls: dict[str, Callable[[], Awaitable[corral.CommandResult]]] = {
                "user": lambda: sbx.commands.run("true", user="user"),
                "sudo": lambda: sbx.commands.run("sudo true", user="user"),
                "root": lambda: sbx.commands.run("true", user="root"),
            }
            for _ in range(5):  # warm: the page cache, the broker's first fork
                for call in calls.values():
                    await call()
            loop = asyncio.get_running_loop()
            for _ in range(n):
                for name, call in calls.items():
                    t0 = loop.time()
                    r = await call()
                    api[name].append(loop.time() - t0)
                    assert r.exit_code == 0, r
            r = await sbx.commands.run(
                ["python3", "-c", f"N = {n}\n" + INSIDE], user="user", timeout=600
            )
            inside = json.loads(r.stdout)
        finally:
            await sbx.close()
    header = ["what", "p50 (ms)", "p99 (ms)", "p50 vs the first row"]
    through_api = [
        row("`true` as the user", api["user"], api["user"]),
        row("`sudo true` as the user (the platform's sudo)", api["sudo"], api["user"]),
        row('`true` as root (`user="root"`: the way round without sudo)', api["root"], api["user"]),
    ]
    within = [
        row("`true`", inside["true"], inside["true"]),
        row("`sudo true`: the client, the broker's fork, root's exec", inside["sudo true"],
            inside["true"]),
    ]  # fmt: skip
    sections = [
        "## Through the exec API\n\n"
        f"One command per call, {n} of each, interleaved, in one sandbox.\n\n"
        + table(header, through_api),
        "## Inside the sandbox\n\n"
        f"A python3 program as the user starting each {n} times, one after another.\n\n"
        + table(header, within),
    ]
    path = write_result("sudo", "The platform's sudo: what it costs", sections)
    print(path.read_text())


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=200)
    asyncio.run(main(p.parse_args().n))
