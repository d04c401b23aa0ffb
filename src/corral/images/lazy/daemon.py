"""`corral lazyd`: the node's lazy loader process.

Runs apart from the node agent so that sandboxes keep reading their layers
while an agent restarts. It holds an exclusive flock on its lock file for
its whole life (the agent's liveness test) and exits when its FUSE mount is
unmounted (the agent does that once no layer mount needs it).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import signal
import sys
from pathlib import Path

from corral.images.lazy.cache import ChunkCache
from corral.images.store import ImageStore
from corral.log import configure, get_logger
from corral.units import parse_size

log = get_logger("corral.lazyd")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="corral-lazyd")
    ap.add_argument("--mount", type=Path, required=True)
    ap.add_argument("--images", type=Path, required=True)
    ap.add_argument("--cache", type=Path, required=True)
    ap.add_argument("--cache-size", default="20GiB")
    ap.add_argument("--lock", type=Path, required=True)
    ap.add_argument("--readahead", type=int, default=4, help="chunks fetched per miss")
    ap.add_argument("--attempts", type=int, default=4)
    ap.add_argument(
        "--deadline", type=float, default=20.0, help="seconds per read, retries included"
    )
    args = ap.parse_args(argv)
    # The loader works for whichever sandbox reads, but its CPU is charged to
    # no sandbox: at a lower priority than the node's request handling, a
    # sandbox reading its whole file system (a recursive grep from /) slows
    # its own reads, not its neighbours' commands.
    os.nice(10)
    configure(os.environ.get("CORRAL_LOG_LEVEL", "info"))

    lock = os.open(args.lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("corral-lazyd: another loader already serves this node", file=sys.stderr)
        return 1
    os.ftruncate(lock, 0)
    os.pwrite(lock, str(os.getpid()).encode(), 0)

    from corral.images.lazy import fs

    args.mount.mkdir(parents=True, exist_ok=True)
    cache = ChunkCache(args.cache, parse_size(args.cache_size, "cache_size"))
    lazy = fs.LazyFS(
        ImageStore(args.images),
        cache,
        readahead=args.readahead,
        attempts=args.attempts,
        deadline=args.deadline,
    )
    import pyfuse3

    signal.signal(signal.SIGTERM, lambda *_: pyfuse3.terminate())
    log.info("lazyd.serving", mount=str(args.mount), cache=str(args.cache))
    try:
        fs.serve(args.mount, lazy)
    finally:
        cache.close()
        log.info("lazyd.stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
