"""A live view's token: who may watch (or drive) one sandbox's screen, on
one node, until when.

A view is opened in a browser, where no Authorization header can be set,
so the token travels in the URL (`/view/<token>`), as E2B's stream key
does. That makes it a bearer credential for one sandbox's screen, so it is
narrow: one sandbox, one node, read-only unless asked, at most an hour;
signed with a key only the node holds (HMAC-SHA256, its own domain tag, so
no other token of Corral's verifies as one).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from dataclasses import dataclass

from corral.api.direct import b64url, unb64url
from corral.errors import InvalidArgument, Unauthenticated

PREFIX = "vt1."
DEFAULT_TTL = 300
MAX_TTL = 3600


@dataclass(frozen=True)
class ViewGrant:
    sandbox_id: str
    interactive: bool
    expires_at: float


def _mac(key: bytes, payload: str) -> str:
    return b64url(hmac.new(key, b"corral-view\0" + payload.encode(), hashlib.sha256).digest())


def check_ttl(ttl: int) -> int:
    if isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= MAX_TTL:
        raise InvalidArgument("ttl", f"must be whole seconds from 1 to {MAX_TTL}", ttl)
    return ttl


def issue(key: bytes, sandbox_id: str, node: str, interactive: bool, ttl: int) -> tuple[str, float]:
    expires = round(time.time() + check_ttl(ttl), 3)
    doc = {"s": sandbox_id, "n": node, "i": bool(interactive), "e": expires}
    payload = b64url(json.dumps(doc).encode())
    return f"{PREFIX}{payload}.{_mac(key, payload)}", expires


MALFORMED = "a view token is vt1.<payload>.<mac>: ask for one with view()"


def node_of(token: str) -> str:
    """The node a token names, unverified: for a gateway to route the view
    to that node, which checks the token itself."""
    try:
        doc = json.loads(unb64url(token.removeprefix(PREFIX).split(".")[0]))
        return str(doc["n"])
    except (ValueError, KeyError, TypeError, IndexError):
        raise Unauthenticated(
            "a view token is vt1.<payload>.<mac>: ask for one with view()"
        ) from None


def verify(key: bytes, token: str, node: str) -> ViewGrant:
    """What `token` grants on `node`; Unauthenticated (saying which rule
    failed) if it is malformed, forged, for another node, or expired."""
    if not token.startswith(PREFIX) or token.count(".") != 2:
        raise Unauthenticated(MALFORMED)
    payload, mac = token.removeprefix(PREFIX).split(".")
    if not hmac.compare_digest(mac.encode(), _mac(key, payload).encode()):
        raise Unauthenticated("the view token's signature does not match")
    try:
        doc = json.loads(unb64url(payload))
        grant = ViewGrant(str(doc["s"]), bool(doc["i"]), float(doc["e"]))
        where = str(doc["n"])
    except (ValueError, KeyError, TypeError):
        raise Unauthenticated("the view token's payload is malformed") from None
    if where != node:
        raise Unauthenticated(f"the view token is for node {where}, not this node ({node})")
    if time.time() >= grant.expires_at:
        raise Unauthenticated(
            f"the view token expired {time.time() - grant.expires_at:.0f} s ago: "
            "ask for another (sbx.display.view())"
        )
    return grant
