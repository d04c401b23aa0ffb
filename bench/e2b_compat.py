"""The E2B path next to Corral's own, against one `corral serve`, in one run.

    corral bench e2b_compat [--quick]

- create to first command: `e2b.AsyncSandbox.create("base")` then
  `commands.run("true")`, against Corral's SDK over HTTP creating the same
  image and running the same command;
- command round trip: `commands.run("true")` on a running sandbox, both ways
  (Corral's side runs the argv E2B's SDK sends, `/bin/bash -l -c true`);
- a burst of N concurrent E2B creates (and one command each): failures and
  wall time;
- fork (E2B's against Corral's) and a file read by signed URL (against the
  SDK's read).
The two paths are alternated in rounds so that neither gets a warmer node.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import corral
from _common import pct, serve, table, timed, wait_up, write_result

DATA = Path("/var/lib/corral-e2b-bench")
SPEC: dict[str, Any] = {
    "image": "debian-python:bookworm",
    "toolkit": ["e2b-user:bookworm", "e2b-tools:bookworm"],
    "memory": "512MiB",
}
# What the E2B SDK runs for commands.run("true"): a login shell. Corral's
# side runs the same argv, so the two rows compare the protocols, not shells.
SAME = ["/bin/bash", "-l", "-c", "true"]


def _ms(xs: list[float]) -> tuple[str, str]:
    return f"{pct(xs, 50) * 1000:.1f}", f"{pct(xs, 99) * 1000:.1f}"


async def _up_for_e2b(url: str) -> None:
    """Wait for the server, then point E2B's SDKs at it (as docs/e2b.md says)."""
    await wait_up(url)
    os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY="e2b_0",
                      E2B_VALIDATE_API_KEY="false", E2B_DOMAIN="corral.local")  # fmt: skip


async def run(quick: bool) -> list[str]:
    import e2b

    rounds, per = (3, 5) if quick else (5, 10)
    trips, burst = (50, 40) if quick else (200, 200)
    proc, url = serve(DATA)
    try:
        await _up_for_e2b(url)
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


async def forks(quick: bool) -> str:
    """E2B's fork next to Corral's (one copy of a running sandbox, the copy
    closed after), and a file read by a signed URL next to the SDK's."""
    import e2b
    import httpx

    n, reads = (5, 50) if quick else (15, 200)
    proc, url = serve(DATA)
    try:
        await _up_for_e2b(url)
        fork: dict[str, list[float]] = {"e2b": [], "corral": []}
        read: dict[str, list[float]] = {"sdk": [], "signed": []}
        async with corral.AsyncClient(url) as c, httpx.AsyncClient() as h:
            es = await e2b.AsyncSandbox.create("base", timeout=600)
            cs = await c.sandboxes.create(**SPEC)

            async def e2b_fork() -> None:
                [copy] = await es.fork(count=1, timeout=120)
                assert isinstance(copy, e2b.AsyncSandbox), copy
                await copy.kill()

            async def corral_fork() -> None:
                [copy] = await c.sandboxes.fork(cs, 1)
                await copy.close()

            for _ in range(n):  # alternated, one each
                fork["e2b"] += await timed(1, e2b_fork)
                fork["corral"] += await timed(1, corral_fork)
            await es.files.write("/home/user/f.txt", "x" * 4096)
            signed_url = es.download_url("/home/user/f.txt", "user")

            async def by_url() -> None:
                r = await h.get(signed_url)
                assert r.status_code == 200 and len(r.content) == 4096, r.status_code

            for _ in range(5):
                read["sdk"] += await timed(reads // 5, lambda: es.files.read("/home/user/f.txt"))
                read["signed"] += await timed(reads // 5, by_url)
            await es.kill()
            await cs.close()
    finally:
        proc.terminate()
        proc.wait(60)
    rows = []
    for what, d, a, b in (
        ("fork, one copy: E2B's / Corral SDK's", fork, "e2b", "corral"),
        ("read a 4 KiB file: E2B SDK's / a signed URL's", read, "sdk", "signed"),
    ):
        a50, a99 = _ms(d[a])
        b50, b99 = _ms(d[b])
        rows.append([what, a50, a99, b50, b99, f"{pct(d[a], 50) / pct(d[b], 50):.2f}x"])
    head = ["what", "E2B p50 ms", "p99 ms", "other p50 ms", "p99 ms", "E2B / other (p50)"]
    body = table(head, rows)
    return ("## Fork, and signed file URLs\n\n" + body + "\n\n"
            "Fork: `sandbox.fork(count=1)` through E2B's API against Corral's SDK "
            f"`sandboxes.fork(sbx, 1)` "
            f"on a sandbox of the same spec, alternated, {n} each; each copy is closed after "
            "(not timed). A container's fork is a CRIU dump of the source and a restore per "
            f"copy. Read: `files.read` (E2B's envd, the token in a header) against a GET of "
            f"the `download_url` (no token: the node finds the sandbox whose token signed "
            f"it, one SHA-256 per E2B sandbox held), {reads} each.")  # fmt: skip


# Timed inside the sandbox: the same /execute, straight to the server.
_INSIDE = """
import json, time, urllib.request
out = []
for _ in range(N):
    t = time.perf_counter()
    req = urllib.request.Request("http://127.0.0.1:49999/execute", method="POST",
        data=json.dumps({"code": "1 + 1"}).encode(), headers={"Content-Type": "application/json"})
    body = urllib.request.urlopen(req).read()
    assert b'"text": "2"' in body, body
    out.append(time.perf_counter() - t)
print(json.dumps(out))
"""


async def interpreter(quick: bool) -> str:
    """e2b-code-interpreter's run_code through Corral (E2b-Sandbox-Port,
    forwarded into the sandbox) vs the same request made inside it."""
    import json

    from e2b_code_interpreter import AsyncSandbox

    creates, trips = (3, 30) if quick else (8, 100)
    proc, url = serve(DATA)
    try:
        await _up_for_e2b(url)
        first: list[float] = []
        for _ in range(creates):
            t0 = time.perf_counter()
            s = await AsyncSandbox.create(timeout=300)
            assert (await s.run_code("1 + 1")).text == "2"
            first.append(time.perf_counter() - t0)
            await s.kill()
        s = await AsyncSandbox.create(timeout=300)
        outside = await timed(trips, lambda: s.run_code("1 + 1"))
        await s.files.write("/tmp/inside.py", _INSIDE.replace("range(N)", f"range({trips})"))
        got = await s.commands.run("python3 /tmp/inside.py")
        inside = [float(x) for x in json.loads(got.stdout)]
        await s.kill()
    finally:
        proc.terminate()
        proc.wait(60)
    f50, f99 = _ms(first)
    o50, o99 = _ms(outside)
    i50, i99 = _ms(inside)
    rows = [
        ["create to first run_code", f50, f99, "", "", ""],
        ["run_code('1 + 1') round trip", o50, o99, i50, i99,
         f"{pct(outside, 50) / pct(inside, 50):.2f}x"],
    ]  # fmt: skip
    note = (f"e2b-code-interpreter 2.9.1 from PyPI, template `code-interpreter-v1` (Jupyter "
            f"and Corral's code-interpreter server; images/interpreter.py). {creates} creates, "
            f"{trips} round trips. Inside: the same POST /execute from python3's urllib in "
            "the sandbox to 127.0.0.1:49999, so the ratio is what reaching the port through "
            "Corral costs. A create starts Jupyter and two kernels (python, Deno) before it "
            "answers.")  # fmt: skip
    return "## The code interpreter\n\n" + table(
        ["what", "through Corral p50 ms", "p99 ms", "inside the sandbox p50 ms", "p99 ms",
         "through / inside (p50)"], rows) + "\n\n" + note  # fmt: skip


async def http2(quick: bool) -> str:
    """The same calls over HTTP/2 cleartext (prior knowledge) and HTTP/1.1,
    one connection each, on one `corral serve`."""
    import httpx

    n = 100 if quick else 400
    proc, url = serve(DATA)
    try:
        await wait_up(url)
        async with (
            corral.AsyncClient(url) as c,
            httpx.AsyncClient(base_url=url) as h1,
            httpx.AsyncClient(base_url=url, http1=False, http2=True) as h2,
        ):
            s = await c.sandboxes.create(**SPEC)
            path = f"/v1/sandboxes/{s.id}"
            got: dict[str, list[float]] = {"HTTP/1.1": [], "HTTP/2": []}
            for _ in range(4):
                for name, h in (("HTTP/1.1", h1), ("HTTP/2", h2)):
                    got[name] += await timed(n // 4, lambda h=h: h.get(path))  # type: ignore[misc]
            assert (await h2.get(path)).http_version == "HTTP/2"
            await s.close()
    finally:
        proc.terminate()
        proc.wait(60)
    rows = []
    for name, xs in got.items():
        p50, p99 = _ms(xs)
        rows.append([name, p50, p99, f"{pct(xs, 50) / pct(got['HTTP/1.1'], 50):.2f}x"])
    return "## HTTP/2 cleartext beside HTTP/1.1\n\n" + table(
        ["GET /v1/sandboxes/{id}", "p50 ms", "p99 ms", "vs HTTP/1.1 (p50)"], rows
    ) + (f"\n\n{n} calls each, alternated; httpx, one connection each. HTTP/1.1 is "
         "uvicorn's httptools parser, HTTP/2 uvicorn's zttp (api/h2c.py).")  # fmt: skip


async def main(quick: bool) -> None:
    sections = await run(quick)
    sections.append(await forks(quick))
    sections.append(await interpreter(quick))
    sections.append(await http2(quick))
    path = write_result("e2b", "E2B compatibility: the E2B SDK against Corral", sections)
    print(path.read_text())


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    asyncio.run(main(ap.parse_args().quick))
