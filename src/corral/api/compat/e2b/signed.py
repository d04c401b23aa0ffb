"""E2B's signed file URLs (`Sandbox.download_url` / `upload_url`): a GET or
POST of envd's `/files` that carries no token, only `signature` (and
`signature_expiration`) in its query, so that a browser or curl can fetch
or put one file.

The SDK signs `path:operation:username:token[:expiration]` with SHA-256
(the sandbox's envd token is the secret; `username` is the query's, empty
when absent; `operation` is `read` for a GET, `write` for a POST) and
sends `v1_` and the unpadded base64 of the digest. A signature answers
for that path, that operation and that user alone.

Such a URL names no sandbox when the SDK was pointed at one endpoint
(E2B_SANDBOX_URL, as Corral's docs say): the sandbox is the one whose
token signs it, found among this server's own sandboxes (a node's; one
hash per E2B sandbox held). A gateway holds no tokens: there the URL
must name its sandbox by host (`49983-<id>.<domain>`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time
from collections.abc import Iterable

from starlette.datastructures import QueryParams

from corral.api.compat.e2b.connect import ConnectError
from corral.api.models import SandboxInfo

INVALID = "invalid signature"
EXPIRED = "signature is already expired"


def signature(path: str, op: str, user: str, token: str, expiration: str | None) -> str:
    raw = f"{path}:{op}:{user}:{token}" + ("" if expiration is None else f":{expiration}")
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode()


_SIGNATURE = re.compile(r"v1_[A-Za-z0-9+/]{43}")  # SHA-256, unpadded base64
_EXPIRATION = re.compile(r"-?[0-9]{1,19}")


def check_form(query: QueryParams) -> None:
    """ConnectError (unauthenticated, INVALID) for a query no SDK signed:
    checked before any sandbox is looked up, so that what a malformed URL
    is told says nothing of which sandboxes exist, and costs no lookup. A
    user holding ':' would make two (path, user) pairs sign alike."""
    expiration = query.get("signature_expiration")
    if (
        not _SIGNATURE.fullmatch(query.get("signature", ""))
        or (expiration is not None and not _EXPIRATION.fullmatch(expiration))
        or ":" in query.get("username", "")
    ):
        raise ConnectError("unauthenticated", INVALID)


def signer(
    query: QueryParams, op: str, candidates: Iterable[SandboxInfo], token_label: str
) -> SandboxInfo:
    """The sandbox among `candidates` whose token made the query's
    signature, its expiration not past. ConnectError (unauthenticated)
    otherwise: the same answer for a wrong signature and for a sandbox
    that is not there."""
    check_form(query)
    given = query.get("signature", "")
    expiration = query.get("signature_expiration")
    path, user = query.get("path", ""), query.get("username", "")
    for info in candidates:
        token = info.labels.get(token_label)
        if not token:
            continue
        wanted = signature(path, op, user, token, expiration)
        if hmac.compare_digest(given.encode(), wanted.encode()):
            if expiration is not None and int(expiration) < time.time():
                raise ConnectError("unauthenticated", EXPIRED)
            return info
    raise ConnectError("unauthenticated", INVALID)
