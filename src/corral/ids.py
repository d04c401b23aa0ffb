"""Sandbox ids: ``<node>-<16 hex digits>``.

One format, parsed in one place. The id names the node that holds the
sandbox, so any gateway replica (or a client holding a direct token) can
route a request without asking anyone; the 64 random bits make ids
unguessable, so knowing one is not enough to reach another project's
sandbox (the gateway still checks ownership).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass

from corral.errors import InvalidArgument

NODE_PATTERN = r"[a-z0-9]{1,16}"
_NODE = re.compile(NODE_PATTERN)
_ID = re.compile(rf"({NODE_PATTERN})-([0-9a-f]{{16}})")
# What a client may send as a path segment: wider than a sandbox id (a
# function-call worker, an id from an older server), but never anything a
# URL could read as more than one segment ("..", "/", "?", "%").
_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}")


@dataclass(frozen=True)
class SandboxId:
    node: str
    token: str

    def __str__(self) -> str:
        return f"{self.node}-{self.token}"


def new(node: str) -> str:
    """A fresh id for a sandbox on `node`."""
    return f"{check_node(node)}-{secrets.token_hex(8)}"


def check_node(node: str, field: str = "node") -> str:
    if not isinstance(node, str) or not _NODE.fullmatch(node):
        raise InvalidArgument(field, f"must match {NODE_PATTERN}", node)
    return node


def parse(sandbox_id: object, field: str = "sandbox_id") -> SandboxId:
    """The parts of a well-formed id; InvalidArgument naming `field` otherwise."""
    m = _ID.fullmatch(sandbox_id) if isinstance(sandbox_id, str) else None
    if m is None:
        raise InvalidArgument(field, "must be <node>-<16 hex digits>", sandbox_id)
    return SandboxId(m.group(1), m.group(2))


def node_of(sandbox_id: str) -> str | None:
    """The node an id names, or None if it is not a well-formed id."""
    m = _ID.fullmatch(sandbox_id)
    return m.group(1) if m else None


def segment(sandbox_id: object, field: str = "sandbox_id") -> str:
    """A sandbox id as one URL path segment: refused if it could be read as
    anything else, so a request can only ever name a sandbox."""
    if not isinstance(sandbox_id, str) or not _SEGMENT.fullmatch(sandbox_id):
        raise InvalidArgument(
            field, "must be 1-100 of [A-Za-z0-9_-], starting alphanumeric", sandbox_id
        )
    return sandbox_id
