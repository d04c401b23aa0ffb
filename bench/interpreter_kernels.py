"""The code interpreter's kernels side by side, through the stock
e2b-code-interpreter client against one `corral serve`, in one run.

    corral bench interpreter_kernels [--quick]

For each language: a new context to its first result (the kernel's start:
Jupyter starts it, the JVM for Java), and the round trip of one trivial
expression on a running context. Python's IPython kernel is the reference
the others are compared with; E2B's own template cannot run here, so the
peer is the kernel every E2B user starts with.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import pct, serve, table, timed, write_result
from e2b_compat import _ms, _up_for_e2b

DATA = Path("/var/lib/corral-e2b-bench")
# language -> (an expression, the text its result shows)
CODE = {
    "python": ("1 + 1", "2"),
    "javascript": ("1 + 1", "2"),
    "r": ("1 + 1", "[1] 2"),
    "java": ("1 + 1", "2"),
}


async def _trips(s: Any, lang: str, n: int) -> list[float]:
    ctx = await s.create_code_context(language=lang)
    try:
        return await timed(n, lambda: s.run_code(CODE[lang][0], context=ctx))
    finally:
        await s.remove_code_context(ctx)


async def run(quick: bool) -> str:
    from e2b_code_interpreter import AsyncSandbox

    starts, trips = (3, 30) if quick else (6, 100)
    proc, url = serve(DATA)
    first: dict[str, list[float]] = {lang: [] for lang in CODE}
    trip: dict[str, list[float]] = {}
    try:
        await _up_for_e2b(url)
        s = await AsyncSandbox.create(timeout=600)
        try:
            for _ in range(starts):
                for lang, (code, want) in CODE.items():
                    t0 = time.perf_counter()
                    ctx = await s.create_code_context(language=lang)
                    r = await s.run_code(code, context=ctx)
                    first[lang].append(time.perf_counter() - t0)
                    got = r.text or (r.results[0].text if r.results else None)
                    assert got == want, (lang, r)
                    await s.remove_code_context(ctx)
            for lang in CODE:
                trip[lang] = await _trips(s, lang, trips)
        finally:
            await s.kill()
    finally:
        proc.terminate()
        proc.wait(60)
    rows = []
    for lang in CODE:
        f50, f99 = _ms(first[lang])
        t50, t99 = _ms(trip[lang])
        ratio = pct(trip[lang], 50) / pct(trip["python"], 50)
        rows.append([lang, f50, f99, t50, t99, f"{ratio:.2f}x"])
    note = (
        f"One sandbox of template `code-interpreter-v1`; e2b-code-interpreter 2.9.1 from "
        f"PyPI over HTTP. {starts} new contexts per language (create_code_context, then "
        f"run_code('1 + 1'), alternating languages), then {trips} round trips of '1 + 1' "
        "on one context per language. R is Debian's IRkernel; Java is Corral's JShell "
        "kernel (docs/e2b.md); JavaScript is Deno."
    )
    head = ["language", "new context to first result p50 ms", "p99 ms",
            "round trip p50 ms", "p99 ms", "round trip / python (p50)"]  # fmt: skip
    return "## Kernels\n\n" + table(head, rows) + "\n\n" + note


async def main(quick: bool) -> None:
    section = await run(quick)
    path = write_result(
        "interpreter_kernels", "The code interpreter's kernels, side by side", [section]
    )
    print(path.read_text())


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    asyncio.run(main(ap.parse_args().quick))
