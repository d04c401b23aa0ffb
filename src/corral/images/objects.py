"""Where layers are kept: an object store with range reads.

Keys mirror the local store's layout (images/store.py):
``blobs/sha256/<hex>``, ``layers/<hex>.json``, ``tags/<name>/<tag>``.
Three backends:
  - a local directory (the embedded default; also how a 3FS or NFS mount is
    used),
  - HTTP (served by `corral blobd` or `corral serve`; ranged GET, PUT),
  - S3-compatible (boto3, the `s3` extra).

Calls are blocking: the lazy loader calls them from worker threads.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any, Protocol

import httpx

from corral.errors import InvalidArgument, NotFound, Unavailable


class ObjectStore(Protocol):
    url: str

    def get_range(self, key: str, offset: int, length: int, timeout: float | None = None) -> bytes:
        """`length` bytes at `offset`; `timeout` bounds the whole transfer."""
        ...

    def get(self, key: str, limit: int | None = None) -> bytes:
        """The whole object; past `limit` bytes, Unavailable (a store may be
        damaged or hostile: it never makes a node hold what it chooses)."""
        ...

    def size(self, key: str) -> int: ...

    def exists(self, key: str) -> bool: ...

    def put_file(self, key: str, path: Path) -> None: ...

    def put_bytes(self, key: str, data: bytes) -> None: ...

    def list(self, prefix: str) -> list[str]: ...


def _check_key(key: str) -> str:
    """A relative object name: no root, no '..' or '.' part, no NUL, no
    backslash (a key names an object, never a place on the host)."""
    parts = key.split("/")
    if (
        not key
        or key.startswith("/")
        or any(p in ("..", ".") for p in parts)
        or "\x00" in key
        or "\\" in key
        or len(key) > 1024
    ):
        raise InvalidArgument("key", "must be a relative object key without '..'", key)
    return key


def _within(data: bytes | bytearray, limit: int | None, key: str, url: str) -> bytes:
    if limit is not None and len(data) > limit:
        raise Unavailable(f"{key} in {url} is larger than {limit} bytes: refused")
    return bytes(data) if isinstance(data, bytearray) else data


class LocalObjects:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.url = str(root)

    def _path(self, key: str) -> Path:
        return self.root / _check_key(key)

    def get_range(self, key: str, offset: int, length: int, timeout: float | None = None) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                return os.pread(f.fileno(), length, offset)
        except FileNotFoundError:
            raise NotFound(f"{key} is not in {self.url}", key=key) from None

    def get(self, key: str, limit: int | None = None) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                data = f.read() if limit is None else f.read(limit + 1)
        except FileNotFoundError:
            raise NotFound(f"{key} is not in {self.url}", key=key) from None
        return _within(data, limit, key, self.url)

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise NotFound(f"{key} is not in {self.url}", key=key) from None

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def put_file(self, key: str, path: Path) -> None:
        dst = self._path(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
        shutil.copyfile(path, tmp)
        os.replace(tmp, dst)

    def put_bytes(self, key: str, data: bytes) -> None:
        dst = self._path(key)
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, dst)

    def list(self, prefix: str) -> list[str]:
        # A prefix is an object name like any key: never a way out of root.
        base = self.root / _check_key(prefix) if prefix else self.root
        if not base.is_dir():
            return []
        return sorted(
            str(p.relative_to(self.root))
            for p in base.rglob("*")
            if p.is_file() and not p.name.startswith(".")
        )


class HttpObjects:
    """An object store behind `corral blobd`: GET/PUT /objects/<key>."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=5.0),
            limits=httpx.Limits(max_connections=64, max_keepalive_connections=32),
        )

    def _get(self, key: str, headers: dict[str, str] | None = None) -> httpx.Response:
        try:
            resp = self._http.get(f"/objects/{_check_key(key)}", headers=headers)
        except httpx.HTTPError as exc:
            raise Unavailable(f"blob store {self.url} unreachable: {exc}") from exc
        if resp.status_code == 404:
            raise NotFound(f"{key} is not in {self.url}", key=key)
        if resp.status_code >= 400:
            raise Unavailable(f"blob store {self.url} answered {resp.status_code} for {key}")
        return resp

    def get_range(self, key: str, offset: int, length: int, timeout: float | None = None) -> bytes:
        # httpx's timeouts bound each socket operation, not a transfer: a
        # store that trickles bytes would never trip them. Count the time.
        deadline = time.monotonic() + timeout if timeout else None
        headers = {"range": f"bytes={offset}-{offset + length - 1}"}
        try:
            with self._http.stream("GET", f"/objects/{_check_key(key)}", headers=headers) as r:
                if r.status_code == 404:
                    raise NotFound(f"{key} is not in {self.url}", key=key)
                if r.status_code >= 400:
                    raise Unavailable(f"blob store {self.url} answered {r.status_code} for {key}")
                parts, got = [], 0
                for part in r.iter_bytes():
                    parts.append(part)
                    got += len(part)
                    if got > length:  # a store may send more than the range: never held
                        raise Unavailable(
                            f"blob store {self.url} sent more than the {length} bytes asked "
                            f"of {key}"
                        )
                    if deadline is not None and time.monotonic() > deadline:
                        raise Unavailable(
                            f"blob store {self.url} too slow: {key} range not done "
                            f"in {timeout:.1f}s"
                        )
                return b"".join(parts)
        except httpx.HTTPError as exc:
            raise Unavailable(f"blob store {self.url} unreachable: {exc}") from exc

    def get(self, key: str, limit: int | None = None) -> bytes:
        try:
            with self._http.stream("GET", f"/objects/{_check_key(key)}") as r:
                if r.status_code == 404:
                    raise NotFound(f"{key} is not in {self.url}", key=key)
                if r.status_code >= 400:
                    raise Unavailable(f"blob store {self.url} answered {r.status_code} for {key}")
                held = bytearray()
                for part in r.iter_bytes():
                    held += part
                    if limit is not None and len(held) > limit:
                        _within(held, limit, key, self.url)  # raises, naming it
                return bytes(held)
        except httpx.HTTPError as exc:
            raise Unavailable(f"blob store {self.url} unreachable: {exc}") from exc

    def size(self, key: str) -> int:
        try:
            resp = self._http.head(f"/objects/{_check_key(key)}")
        except httpx.HTTPError as exc:
            raise Unavailable(f"blob store {self.url} unreachable: {exc}") from exc
        if resp.status_code == 404:
            raise NotFound(f"{key} is not in {self.url}", key=key)
        return int(resp.headers["content-length"])

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except NotFound:
            return False
        return True

    def put_file(self, key: str, path: Path) -> None:
        with open(path, "rb") as f:
            self._put(key, f)

    def put_bytes(self, key: str, data: bytes) -> None:
        self._put(key, data)

    def _put(self, key: str, content: Any) -> None:
        try:
            resp = self._http.put(f"/objects/{_check_key(key)}", content=content, timeout=600)
        except httpx.HTTPError as exc:
            raise Unavailable(f"blob store {self.url} unreachable: {exc}") from exc
        if resp.status_code >= 400:
            raise Unavailable(f"blob store {self.url} refused {key}: {resp.status_code}")

    def list(self, prefix: str) -> list[str]:
        try:
            resp = self._http.get("/objects", params={"prefix": prefix})
        except httpx.HTTPError as exc:
            raise Unavailable(f"blob store {self.url} unreachable: {exc}") from exc
        return list(resp.json()["keys"])


class S3Objects:
    """An S3-compatible bucket (AWS, MinIO, Ceph RGW): s3://bucket/prefix."""

    def __init__(self, url: str) -> None:
        try:
            import boto3
        except ImportError:
            raise Unavailable("s3:// stores need boto3: pip install 'corral[s3]'") from None
        self.url = url
        rest = url.removeprefix("s3://")
        self.bucket, _, prefix = rest.partition("/")
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self._s3 = boto3.client("s3", endpoint_url=os.environ.get("CORRAL_S3_ENDPOINT"))

    def _key(self, key: str) -> str:
        return self.prefix + _check_key(key)

    def get_range(self, key: str, offset: int, length: int, timeout: float | None = None) -> bytes:
        return self._read(key, length, Range=f"bytes={offset}-{offset + length - 1}")

    def get(self, key: str, limit: int | None = None) -> bytes:
        return self._read(key, limit)

    def _read(self, key: str, limit: int | None, **kw: Any) -> bytes:
        try:
            body = self._s3.get_object(Bucket=self.bucket, Key=self._key(key), **kw)["Body"]
            data = bytes(body.read() if limit is None else body.read(limit + 1))
            return _within(data, limit, key, self.url)
        except (NotFound, Unavailable):
            raise
        except self._s3.exceptions.NoSuchKey:
            raise NotFound(f"{key} is not in {self.url}", key=key) from None
        except Exception as exc:
            raise Unavailable(f"s3 store {self.url}: {exc}") from exc

    def size(self, key: str) -> int:
        try:
            head = self._s3.head_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as exc:
            raise NotFound(f"{key} is not in {self.url}", key=key) from exc
        return int(head["ContentLength"])

    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except NotFound:
            return False
        return True

    def put_file(self, key: str, path: Path) -> None:
        self._s3.upload_file(str(path), self.bucket, self._key(key))

    def put_bytes(self, key: str, data: bytes) -> None:
        self._s3.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def list(self, prefix: str) -> list[str]:
        out: list[str] = []
        pages = self._s3.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self._key(prefix)
        )
        for page in pages:
            out += [o["Key"][len(self.prefix) :] for o in page.get("Contents", [])]
        return sorted(out)


def operator_key() -> str | None:
    """The operator's blob store key (CORRAL_BLOB_KEY), for the stores the
    operator named itself: the CLI's push/pull and the origins of layers
    it pulled. Never sent to a store a request named (open_store sends
    only the key it is given)."""
    return os.environ.get("CORRAL_BLOB_KEY")


def open_store(url: str, api_key: str | None = None) -> ObjectStore:
    """A store from its URL: a directory path, http(s)://, or s3://. Only
    `api_key` is sent, and only to this store."""
    if url.startswith(("http://", "https://")):
        return HttpObjects(url, api_key=api_key)
    if url.startswith("s3://"):
        return S3Objects(url)
    if url.startswith("file://"):
        url = url.removeprefix("file://")
    if not url.startswith("/"):
        raise InvalidArgument(
            "store", "must be an absolute directory, http(s):// or s3:// URL", url
        )
    return LocalObjects(Path(url))


def retrying(fn: Any, *, attempts: int, timeout: float, what: str) -> Any:
    """Call fn(remaining_seconds) until it succeeds, at most `attempts` times
    within `timeout` seconds in all; NotFound is final. Raises Unavailable
    at the end."""
    deadline = time.monotonic() + timeout
    delay, last = 0.05, None
    for _ in range(attempts):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            return fn(remaining)
        except NotFound:
            raise
        except Exception as exc:
            last = exc
        if time.monotonic() + delay > deadline:
            break
        time.sleep(delay)
        delay = min(delay * 2, 1.0)
    raise Unavailable(f"{what}: gave up after retries: {last}")
