"""envd's token check on a gateway (api/compat/e2b/envd.py): whoever holds
no token of a sandbox learns nothing of it. A sandbox that does not exist
(the gateway's lookup of its project fails), a malformed id and a real one
with a wrong token all get the same answer."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from corral import labels
from corral.api.compat.e2b import envd, ports
from corral.api.compat.e2b.connect import ConnectError
from corral.errors import InvalidArgument, SandboxNotFound

pytestmark = pytest.mark.unit

REAL = "n0-" + "a" * 16


class _Service:
    async def get(self, sandbox_id: str) -> Any:
        state = SimpleNamespace(value="running")
        return SimpleNamespace(labels={labels.E2B_TOKEN: "right"}, state=state)


async def _for_sandbox(sandbox_id: str) -> Any:
    if sandbox_id == REAL:
        return _Service()
    if sandbox_id.startswith("n0-"):
        raise SandboxNotFound(f"no sandbox {sandbox_id}", sandbox=sandbox_id)
    raise InvalidArgument("sandbox_id", "must be <node>-<16 hex>", sandbox_id)


@pytest.mark.parametrize(
    ("sandbox_id", "token"),
    [
        (REAL, "wrong"),
        ("n0-" + "b" * 16, "wrong"),  # none such: the gateway finds no project
        ("n0-" + "b" * 16, "right"),
        ("not-an-id", "right"),
    ],
)
async def test_no_token_no_word_of_the_sandbox(sandbox_id: str, token: str) -> None:
    e = envd.Envd(_for_sandbox)
    with pytest.raises(ConnectError) as err:
        await e.checked(sandbox_id, token)
    assert (err.value.code, err.value.message) == (
        "unauthenticated",
        "X-Access-Token is not this sandbox's",
    )
    assert sandbox_id not in str(err.value)


async def test_the_right_token_opens_it() -> None:
    svc = await envd.Envd(_for_sandbox).checked(REAL, "right")
    assert isinstance(svc, _Service)


@pytest.mark.parametrize(
    ("sent", "forwarded"),
    [
        (("x-api-key", "ck_project-key"), None),
        (("authorization", "Bearer ck_project-key"), None),
        (("authorization", "Bearer  ck_project-key"), None),  # the resolver strips spaces
        (("authorization", "ck_project-key"), None),  # and takes one with no scheme
        (("authorization", "node-api-key"), None),
        (("Authorization", "bearer dt1.direct.token"), None),
        (("authorization", "Bearer node-api-key"), None),  # this server's own key
        (("cookie", "__Host-corral_key=ck_k; a=1"), ("cookie", "a=1")),
        (("cookie", "corral_key=ck_project-key"), None),
        (("cookie", "session=1; corral_key=ck_project-key; theme=dark"), ("cookie", "session=1; theme=dark")),
        (("x-access-token", "envd-token"), None),
        (("e2b-traffic-access-token", "traffic-token"), None),
        # The sandbox's server's own credentials pass.
        (("authorization", "Bearer its-own-jwt"), ("authorization", "Bearer its-own-jwt")),
        (("authorization", "Basic dXNlcjpwYXNz"), ("authorization", "Basic dXNlcjpwYXNz")),
        (("cookie", "session=1"), ("cookie", "session=1")),
    ],
)  # fmt: skip
def test_a_port_request_carries_no_corral_credential_into_the_sandbox(
    sent: tuple[str, str], forwarded: tuple[str, str] | None
) -> None:
    got = ports._outgoing([sent, ("accept", "*/*")], own_key="node-api-key")
    assert got == ([forwarded] if forwarded else []) + [("accept", "*/*")]


@pytest.mark.parametrize(
    ("header", "kept"),
    [
        ((b"set-cookie", b"session=1; Path=/; HttpOnly"), True),
        ((b"set-cookie", b"corral_key=ck_attackers; Path=/"), False),
        ((b"set-cookie", b"__Host-corral_key=ck_attackers; Path=/; Secure"), False),
        ((b"set-cookie", b"track=1; Domain=example.com"), False),  # wider than the host
        ((b"strict-transport-security", b"max-age=63072000"), False),
        ((b"transfer-encoding", b"chunked"), False),
        ((b"content-type", b"text/html"), True),
    ],
)
def test_a_port_answer_sets_nothing_on_corrals_own_host(
    header: tuple[bytes, bytes], kept: bool
) -> None:
    """The header-routed path answers on the gateway's own host: a sandbox's
    server may set its own cookies, not Corral's login, not a cookie for a
    wider domain, and not HSTS for the host."""
    got = ports._answered([header, (b"set-cookie", b"b=2")])
    assert got == ([header] if kept else []) + [(b"set-cookie", b"b=2")]
