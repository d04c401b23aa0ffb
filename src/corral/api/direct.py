"""Direct tokens: a client talks to a sandbox's node without the gateway.

After placement, exec and file traffic need no gateway: the sandbox id
names its node. A gateway issues, for one sandbox of the caller's project,
a token the node checks by itself (no state store, no call back):

    dt1.<payload>.<mac>    payload = base64url(JSON {s: sandbox, n: node, e: expiry})
                           mac = base64url(HMAC-SHA256(node key, "corral-direct\\0" + payload))

The node key is the secret the gateway and its nodes already share; a
token is not a key: it is good for one sandbox, for the operations in
ALLOWED only (those that act inside the sandbox: commands, files, the
display, its usage and audit), on that node, until it expires (at most
MAX_TTL). What changes a sandbox's lifetime, placement, quota or policy
(close, fork, save, suspend, TTL, network, protect, commit) stays on the
gateway, which keeps the rows and the charges.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Callable
from typing import Any, cast

from corral import labels
from corral.api.service import SandboxService
from corral.errors import InvalidArgument, Unauthenticated

PREFIX = "dt1."
DEFAULT_TTL = 300
MAX_TTL = 3600
ALLOWED = frozenset(
    {
        "get", "exec", "kill", "resize_pty", "send_stdin", "read_file", "write_file",
        "list_files", "stat_file", "make_dir", "set_xattrs", "remove_file", "upload_tar",
        "download_tar", "usage", "audit", "command_log", "screenshot", "display_input",
        "display_state", "display_windows", "display_apps", "display_launch",
    }
)  # fmt: skip


def b64url(data: bytes) -> str:
    """Unpadded URL-safe base64: a token part that needs no escaping."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(secret: str, payload: str) -> str:
    return b64url(
        hmac.new(secret.encode(), b"corral-direct\0" + payload.encode(), hashlib.sha256).digest()
    )


def check_ttl(ttl: int) -> int:
    if isinstance(ttl, bool) or not isinstance(ttl, int) or not 1 <= ttl <= MAX_TTL:
        raise InvalidArgument("ttl", f"must be whole seconds from 1 to {MAX_TTL}", ttl)
    return ttl


def issue(secret: str, sandbox_id: str, node: str, ttl: int) -> tuple[str, float]:
    """A token for `sandbox_id` on `node`, and when it expires."""
    expires = round(time.time() + check_ttl(ttl), 3)
    payload = b64url(json.dumps({"s": sandbox_id, "n": node, "e": expires}).encode())
    return f"{PREFIX}{payload}.{_mac(secret, payload)}", expires


def is_token(text: str) -> bool:
    return text.startswith(PREFIX)


def verify(secret: str, token: str, node: str) -> str:
    """The sandbox id `token` is good for on `node`; Unauthenticated if it
    is forged, for another node, or expired."""
    try:
        payload, mac = token.removeprefix(PREFIX).split(".")
    except ValueError:
        raise Unauthenticated("a direct token is dt1.<payload>.<mac>") from None
    if not hmac.compare_digest(mac.encode(), _mac(secret, payload).encode()):
        raise Unauthenticated("the direct token's signature does not match")
    try:
        doc = json.loads(unb64url(payload))
        sandbox, where, expires = str(doc["s"]), str(doc["n"]), float(doc["e"])
    except (ValueError, KeyError, TypeError):
        raise Unauthenticated("the direct token's payload is malformed") from None
    if where != node:
        raise Unauthenticated(f"the direct token is for node {where}, not this node ({node})")
    if time.time() >= expires:
        raise Unauthenticated(
            f"the direct token expired {time.time() - expires:.0f} s ago: ask the gateway "
            "for another (sbx.direct())"
        )
    return sandbox


class DirectService:
    """A node's service as a direct token sees it: one sandbox, ALLOWED only."""

    def __init__(self, service: SandboxService, sandbox_id: str) -> None:
        self._service, self._sandbox = service, sandbox_id

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name not in ALLOWED:
            raise Unauthenticated(
                f"a direct token does not allow {name}: send it through the gateway"
            )
        method = getattr(self._service, name)

        def call(*args: Any, **kw: Any) -> Any:
            target = args[0] if args else kw.get("sandbox_id")
            if target != self._sandbox:
                raise Unauthenticated(f"the direct token is for sandbox {self._sandbox} only")
            return method(*args, **kw)

        async def get(*args: Any, **kw: Any) -> Any:
            # A direct token lives an hour at most; the sandbox's own E2B
            # tokens live as long as it does: never handed across.
            info = await call(*args, **kw)
            return info.model_copy(update={"labels": labels.without_secrets(info.labels)})

        return get if name == "get" else call

    def as_service(self) -> SandboxService:
        return cast(SandboxService, self)
