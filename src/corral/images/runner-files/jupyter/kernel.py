"""The warm Jupyter kernel of a function-call worker (/run_jupyter).

Runs inside the worker, as the call's user, with the worker's Python and
the fncall-python toolkit's jupyter_client and ipykernel.

  kernel.py serve       after every reset of the worker: starts a python3
                        kernel in /work, checks it answers, and leaves a
                        daemon holding it on a socket; exits 0 once it is
                        ready (1 with the reason otherwise).
  kernel.py call FILE   one call: FILE holds {"cells", "cell_timeout",
                        "total_timeout"}; the cells' results go to stdout
                        as one JSON document.

The daemon serves one call: the worker is reset (every process killed,
/tmp and /work emptied) before the next one, and `serve` runs again, so no
call sees a kernel another call used.

Invariant: cells run in order; a cell that raises does not stop the next
(as in SandboxFusion); a cell past its time is interrupted and ends the
call, with the limit it passed named in "timed_out".
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import subprocess
import sys
import time
from typing import Any

SOCK = "/tmp/.corral-jupyter.sock"
READY_WITHIN = 60.0


async def _kernel() -> tuple[Any, Any]:
    from jupyter_client import AsyncKernelManager

    km = AsyncKernelManager(kernel_name="python3")
    # The kernel's own stdout and stderr go nowhere: what a cell prints
    # reaches us as messages, and nothing it writes lands in our output.
    await km.start_kernel(cwd="/work", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    kc = km.client()
    kc.start_channels()
    await kc.wait_for_ready(timeout=READY_WITHIN)
    seen: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["header"]["msg_type"] == "stream":
            seen.append(msg["content"]["text"])

    await kc.execute_interactive("print(123)", output_hook=hook, timeout=10)
    if "".join(seen) != "123\n":
        raise RuntimeError(f"the kernel answered {''.join(seen)!r} to print(123)")
    return km, kc


async def _run(kc: Any, km: Any, req: dict[str, Any]) -> dict[str, Any]:
    cells = req["cells"]
    per_cell = float(req.get("cell_timeout") or 0) or math.inf
    total = float(req.get("total_timeout") or 0) or math.inf
    deadline = time.monotonic() + total
    results: list[dict[str, Any]] = []
    out: dict[str, Any] = {"status": "Finished", "cells": results}
    for i, code in enumerate(cells):
        left = deadline - time.monotonic()
        limit, field = (per_cell, "cell_timeout") if per_cell <= left else (left, "total_timeout")
        cell: dict[str, Any] = {"stdout": "", "stderr": "", "display": [], "error": []}
        results.append(cell)

        def hook(msg: dict[str, Any], cell: dict[str, Any] = cell) -> None:
            kind, content = msg["header"]["msg_type"], msg["content"]
            if kind == "stream" and content.get("name") in ("stdout", "stderr"):
                cell[content["name"]] += content["text"]
            elif kind in ("display_data", "execute_result"):
                cell["display"].append(content["data"])
            elif kind == "error":
                cell["error"].append(content)

        try:
            reply = await kc.execute_interactive(
                code, output_hook=hook, timeout=None if limit == math.inf else max(limit, 0.001)
            )
        except TimeoutError:
            await km.interrupt_kernel()
            out["status"] = "TimeLimitExceeded"
            out["timed_out"] = {"cell": i, "field": field, "limit": limit}
            cell["status"] = "timeout"
            break
        cell["status"] = reply["content"]["status"]
    return out


async def _daemon(ready_fd: int) -> None:
    try:
        km, kc = await _kernel()
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(SOCK)
        server.listen(1)
    except Exception as exc:
        os.write(ready_fd, f"the kernel did not start: {exc}".encode()[:4000])
        raise SystemExit(1) from None
    os.write(ready_fd, b"ok")
    os.close(ready_fd)
    server.setblocking(False)
    loop = asyncio.get_running_loop()
    conn, _ = await loop.sock_accept(server)
    data = b""
    while chunk := await loop.sock_recv(conn, 1 << 16):
        data += chunk
    try:
        answer = await _run(kc, km, json.loads(data))
    except Exception as exc:
        answer = {"status": "Error", "cells": [], "error": str(exc)}
    await loop.sock_sendall(conn, json.dumps(answer).encode())
    conn.close()
    await asyncio.sleep(math.inf)  # held until the worker's reset kills us


def serve() -> int:
    r, w = os.pipe()
    if os.fork():
        os.close(w)
        with os.fdopen(r, "rb") as f:
            said = f.read()
        if said == b"ok":
            return 0
        sys.stderr.write((said or b"the kernel's daemon died before it was ready").decode())
        return 1
    os.close(r)
    os.setsid()  # outlives this command; the worker's reset kills it
    if os.fork():
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    asyncio.run(_daemon(w))
    return 0


def call(path: str) -> int:
    with open(path, "rb") as f:
        req = f.read()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(SOCK)
    except OSError as exc:
        sys.stderr.write(f"the worker's kernel is not running: {exc}\n")
        return 2
    s.sendall(req)
    s.shutdown(socket.SHUT_WR)
    while chunk := s.recv(1 << 16):
        sys.stdout.buffer.write(chunk)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        sys.exit(serve())
    if sys.argv[1:2] == ["call"] and len(sys.argv) == 3:
        sys.exit(call(sys.argv[2]))
    sys.stderr.write("usage: kernel.py serve | kernel.py call FILE\n")
    sys.exit(2)
