"""The HTTP object store: `corral blobd`, also mounted by `corral serve` at /blobs.

    GET  /objects/<key>          the object; honours `Range: bytes=a-b`
    HEAD /objects/<key>          its size
    PUT  /objects/<key>          store an object (API key needed if set)
    GET  /objects?prefix=<p>     {"keys": [...]}

`rate` caps the bytes per second the server sends, all connections together
(a token bucket), to stand in for a remote store's bandwidth.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from corral.errors import InvalidArgument
from corral.images.objects import LocalObjects

PIECE = 64 * 1024
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class TokenBucket:
    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.tokens = 0.0
        self.stamp = time.monotonic()
        self.lock = asyncio.Lock()

    async def take(self, n: int) -> None:
        async with self.lock:
            while True:
                now = time.monotonic()
                self.tokens = min(self.rate * 0.05, self.tokens + (now - self.stamp) * self.rate)
                self.stamp = now
                if self.tokens >= n or self.tokens >= self.rate * 0.05:
                    self.tokens -= n
                    return
                await asyncio.sleep((n - self.tokens) / self.rate)


def create_blob_app(
    root: Path,
    *,
    rate: float | None = None,
    api_key: str | None = None,
    app: FastAPI | None = None,
    prefix: str = "",
    serves: tuple[str, ...] | None = None,
) -> FastAPI:
    """`serves`: the key prefixes it serves, read only (a node's live layer
    store: its blobs, manifests and tags, never its origins, work files or
    pulled OCI trees, and nothing written); None: a store of its own, all
    of it, writable with the key."""
    app = app or FastAPI(title="Corral blob store")
    store = LocalObjects(root)
    real_root = root.resolve()
    bucket = TokenBucket(rate) if rate else None
    sent = {"bytes": 0}

    def allowed(request: Request) -> bool:
        if api_key is None:
            return True
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(given.encode(), api_key.encode())

    def unauthenticated() -> JSONResponse:
        return JSONResponse({"error": "a valid API key is required"}, status_code=401)

    def path_of(key: str) -> Path | None:
        if serves is not None and not key.startswith(serves):
            return None
        try:
            p = store._path(key)
            # No link anywhere in it: a file an image put in a work tree (an
            # absolute symlink) is never followed out of the store.
            real = p.resolve(strict=True)
        except Exception:
            return None
        if real != real_root / p.relative_to(root) or not real.is_file():
            return None
        return real

    async def body(path: Path, start: int, length: int) -> AsyncIterator[bytes]:
        with open(path, "rb") as f:
            off, end = start, start + length
            while off < end:
                n = min(PIECE, end - off)
                if bucket is not None:
                    await bucket.take(n)
                data = os.pread(f.fileno(), n, off)
                if not data:
                    return
                off += len(data)
                sent["bytes"] += len(data)
                yield data

    @app.get(prefix + "/objects/{key:path}")
    async def get(key: str, request: Request) -> Response:
        if not allowed(request):
            return unauthenticated()
        path = path_of(key)
        if path is None:
            return JSONResponse({"error": "not found"}, status_code=404)
        size = path.stat().st_size
        start, length, status = 0, size, 200
        m = _RANGE.match(request.headers.get("range", ""))
        if m:
            start = int(m.group(1))
            end = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
            if start > end:
                return Response(status_code=416, headers={"content-range": f"bytes */{size}"})
            length, status = end - start + 1, 206
        headers = {"content-length": str(length), "accept-ranges": "bytes"}
        if status == 206:
            headers["content-range"] = f"bytes {start}-{start + length - 1}/{size}"
        return StreamingResponse(
            body(path, start, length),
            status_code=status,
            headers=headers,
            media_type="application/octet-stream",
        )

    @app.head(prefix + "/objects/{key:path}")
    async def head(key: str, request: Request) -> Response:
        if not allowed(request):
            return Response(status_code=401)
        path = path_of(key)
        if path is None:
            return Response(status_code=404)
        return Response(headers={"content-length": str(path.stat().st_size)})

    @app.put(prefix + "/objects/{key:path}")
    async def put(key: str, request: Request) -> Response:
        if not allowed(request):
            return unauthenticated()
        if serves is not None:
            return JSONResponse({"error": "this store is read only"}, status_code=405)
        try:
            dst = store._path(key)
        except Exception:
            return JSONResponse({"error": "bad key"}, status_code=400)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.up{os.getpid()}{id(request)}")
        with open(tmp, "wb") as f:
            async for chunk in request.stream():
                f.write(chunk)
        os.replace(tmp, dst)
        return Response(status_code=204)

    @app.get(prefix + "/objects")
    async def list_keys(request: Request) -> Response:
        if not allowed(request):
            return unauthenticated()
        wanted = request.query_params.get("prefix", "")
        try:
            keys = store.list(wanted)
        except InvalidArgument as exc:
            return JSONResponse({"error": exc.message}, status_code=400)
        if serves is not None:
            keys = [k for k in keys if path_of(k) is not None]
        return JSONResponse({"keys": keys})

    @app.get(prefix + "/stats")
    async def stats(request: Request) -> Response:
        if not allowed(request):
            return unauthenticated()
        return JSONResponse(dict(sent))

    return app
