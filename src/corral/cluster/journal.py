"""<dir>/cluster.json: what `cluster up` started, written before each start.

It is the cluster's journal and its client file at once: `up` records
each part (the local PostgreSQL, the local Ray, the node agents) *before*
starting it, so whatever point `up` is killed at, `down` finds everything
that may be running. `phase` is "starting" until `up` has seen every part
answer, then "up". The file is 0600 from its first byte (it holds the
nodes' key and a project key) and replaced atomically.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from corral.errors import NotFound

STARTING, UP = "starting", "up"


def path_of(directory: Path) -> Path:
    return directory / "cluster.json"


def load(directory: Path) -> dict[str, Any]:
    path = path_of(directory)
    if not path.exists():
        raise NotFound(f"no cluster in {directory} ({path} is missing): run corral cluster up")
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def load_or_new(directory: Path) -> dict[str, Any]:
    try:
        return load(directory)
    except NotFound:
        return {}


def save(directory: Path, doc: dict[str, Any]) -> None:
    path = path_of(directory)
    tmp = path.with_name(f".cluster.json.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(doc, indent=2) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def remove(directory: Path) -> None:
    path_of(directory).unlink(missing_ok=True)
