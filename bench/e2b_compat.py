"""The E2B path next to Corral's own, against one `corral serve`, in one run.

    corral bench e2b_compat [--quick]

- create to first command: `e2b.AsyncSandbox.create("base")` then
  `commands.run("true")`, against Corral's SDK over HTTP creating the same
  image and running the same command;
- command round trip: `commands.run("true")` on a running sandbox, both ways
  (Corral's side runs the argv E2B's SDK sends, `/bin/bash -l -c true`);
- a burst of N concurrent E2B creates (and one command each): failures and
  wall time.
The two paths are alternated in rounds so that neither gets a warmer node.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corral
from _common import IMAGES, pct, table, timed, write_result

DATA = Path("/var/lib/corral-e2b-bench")
SPEC = {"image": "debian-python:bookworm", "toolkit": "e2b-user:bookworm", "memory": "512MiB"}
# What the E2B SDK runs for commands.run("true"): a login shell. Corral's
# side runs the same argv, so the two rows compare the protocols, not shells.
SAME = ["/bin/bash", "-l", "-c", "true"]


def _ms(xs: list[float]) -> tuple[str, str]:
    return f"{pct(xs, 50) * 1000:.1f}", f"{pct(xs, 99) * 1000:.1f}"


def _serve() -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "CORRAL_IMAGES": str(IMAGES)}
    argv = [sys.executable, "-m", "corral.cli.main", "--data-dir", str(DATA), "serve",
            "--port", str(port), "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


async def _wait_up(url: str) -> None:
    import httpx

    for _ in range(300):
        try:
            async with httpx.AsyncClient() as h:
                if (await h.get(f"{url}/healthz")).status_code == 200:
                    return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError("corral serve did not start")


async def run(quick: bool) -> list[str]:
    import e2b

    rounds, per = (3, 5) if quick else (5, 10)
    trips, burst = (50, 40) if quick else (200, 200)
    proc, url = _serve()
    try:
        await _wait_up(url)
        os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY="e2b_0",
                          E2B_VALIDATE_API_KEY="false", E2B_DOMAIN="corral.local")  # fmt: skip
        made: dict[str, list[float]] = {"e2b": [], "corral": []}
        async with corral.AsyncClient(url) as c:

            async def e2b_first() -> None:
                s = await e2b.AsyncSandbox.create("base", timeout=300)
                await s.commands.run("true")
                await s.kill()

            async def corral_first() -> None:
                s = await c.sandboxes.create(**SPEC)
                await s.commands.run(SAME)
                await s.close()

            for _ in range(rounds):
                made["e2b"] += await timed(per, e2b_first)
                made["corral"] += await timed(per, corral_first)
            es = await e2b.AsyncSandbox.create("base", timeout=300)
            cs = await c.sandboxes.create(**SPEC)
            trip: dict[str, list[float]] = {"e2b": [], "corral": []}
            for _ in range(rounds):
                trip["e2b"] += await timed(trips // rounds, lambda: es.commands.run("true"))
                trip["corral"] += await timed(trips // rounds, lambda: cs.commands.run(SAME))
            await es.kill()
            await cs.close()

        async def one() -> None:
            s = await e2b.AsyncSandbox.create("base", timeout=300)
            try:
                await s.commands.run("true")
            finally:
                await s.kill()

        t0 = time.perf_counter()
        outcomes = await asyncio.gather(*(one() for _ in range(burst)), return_exceptions=True)
        wall = time.perf_counter() - t0
        failed = [o for o in outcomes if isinstance(o, BaseException)]
    finally:
        proc.terminate()
        proc.wait(60)
    rows = []
    for what, d in (("create to first command", made), ("command round trip", trip)):
        e50, e99 = _ms(d["e2b"])
        c50, c99 = _ms(d["corral"])
        ratio = pct(d["e2b"], 50) / pct(d["corral"], 50)
        rows.append([what, e50, e99, c50, c99, f"{ratio:.2f}x"])
    first = table(["what", "E2B SDK p50 ms", "p99 ms", "Corral SDK p50 ms", "p99 ms",
                   "E2B / Corral (p50)"], rows)  # fmt: skip
    note = (f"Both over HTTP to the same `corral serve`, alternated in {rounds} rounds "
            f"({len(made['e2b'])} creates, {len(trip['e2b'])} round trips each way). The E2B "
            "SDK is e2b 2.45.1 from PyPI; template `base` is Corral's spec's image; both run "
            "`/bin/bash -l -c true` (what E2B's commands.run sends). The E2B p99 of create "
            "includes the SDK's first connection.")  # fmt: skip
    errs = sorted({f"{type(f).__name__}: {f}"[:120] for f in failed})
    second = table(
        ["concurrent E2B creates (+ one command each)", "failed", "wall s", "per s"],
        [[str(burst), str(len(failed)), f"{wall:.1f}", f"{burst / wall:.1f}"]],
    )
    return ["## The E2B path vs Corral's own\n\n" + first + "\n\n" + note,
            "## A burst through the E2B API\n\n" + second
            + ("\n\nErrors: " + "; ".join(errs) if errs else "")]  # fmt: skip


async def main(quick: bool) -> None:
    sections = await run(quick)
    path = write_result("e2b", "E2B compatibility: the E2B SDK against Corral", sections)
    print(path.read_text())


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    asyncio.run(main(ap.parse_args().quick))
