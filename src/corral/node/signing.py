"""Saved sandbox states are signed: a node loads only states a node sharing its
key saved.

Loading a state feeds QEMU's device-state parser, which was never meant to
read hostile input, and the record beside the state says what the new
sandbox may use (its size, its layers). Both come back from an object store
that users can write to. So save() writes an HMAC over the object's name and
its record (which holds the state file's sha256), and restore() checks the
HMAC before it trusts the record, and the state's digest before QEMU reads
a byte of it. The key is a file every node of a cluster shares (by default
beside the shared image store), made on first use.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path


def load_key(path: Path) -> bytes:
    """The signing key at `path`, made (0600, 32 random bytes) if missing."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    try:
        os.link(tmp, path)  # the first writer wins; the others read its key
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_bytes()


def sign(key: bytes, name: str, record: bytes) -> str:
    return hmac.new(key, name.encode() + b"\0" + record, hashlib.sha256).hexdigest()


def verify(key: bytes, name: str, record: bytes, mac: str) -> bool:
    return hmac.compare_digest(sign(key, name, record), mac.strip())


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()
