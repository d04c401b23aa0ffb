"""A keyless server (`corral serve` on loopback, no --api-key) trusts
whoever reaches it. A page elsewhere can reach it by re-pointing its own
name at 127.0.0.1 (DNS rebinding): its requests are then same-origin to
the browser, but name that other host. They are refused; loopback names,
unix sockets and requests carrying a sandbox's own token pass."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from corral.api.app import create_app
from corral.api.liveview import NOVNC, mount_novnc

pytestmark = pytest.mark.unit


class _Service:
    async def list(self, labels: object = None) -> list[object]:
        return []


async def _get(
    url: str, path: str, *, loopback_only: bool = True, headers: dict[str, str] | None = None
) -> httpx.Response:
    app = create_app(_Service(), loopback_only=loopback_only)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=url) as c:
        return await c.get(path, headers=headers or {})


@pytest.mark.parametrize(
    "url", ["http://evil.example:7070", "http://127.0.0.1.nip.io:7070", "http://10.1.2.3:7070"]
)
async def test_a_rebound_name_is_refused(url: str) -> None:
    r = await _get(url, "/v1/sandboxes")
    assert r.status_code == 403
    error = r.json()["error"]
    assert error["code"] == "permission_denied" and "loopback names only" in error["message"]
    assert (await _get(url, "/healthz")).status_code == 403  # reads too: they are the prize


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:7070", "http://localhost:7070", "http://[::1]:7070",
            "http://app.localhost:7070", "http://127.0.0.2:7070"],
)  # fmt: skip
async def test_loopback_names_pass(url: str) -> None:
    assert (await _get(url, "/v1/sandboxes")).status_code == 200


async def test_a_keyed_server_is_not_this_checks_and_no_header_exempts_a_rebound_name() -> None:
    assert (await _get("http://evil.example", "/healthz", loopback_only=False)).status_code == 200
    # After a rebinding the page is same-origin and sends what it likes.
    for header in ("x-access-token", "e2b-traffic-access-token", "authorization"):
        r = await _get("http://evil.example:7070", "/v1/sandboxes", headers={header: "x"})
        assert r.status_code == 403, header


@pytest.mark.skipif(
    not (NOVNC / "core" / "rfb.js").is_file(), reason=f"requires noVNC in {NOVNC} (apt novnc)"
)
async def test_only_novncs_modules_are_served_not_its_pages() -> None:
    """noVNC's own pages take a VNC server and password from their URL: on
    Corral's origin, a link to one would connect the operator anywhere."""
    app = FastAPI()
    mount_novnc(app)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        assert (await c.get("/view/novnc/core/rfb.js")).status_code == 200
        assert (await c.get("/view/novnc/vendor/pako/lib/zlib/inflate.js")).status_code == 200
        for page in ("vnc.html", "vnc_lite.html", "vnc_auto.html", "app/ui.js"):
            assert (await c.get(f"/view/novnc/{page}")).status_code == 404, page


async def test_a_host_that_names_a_sandboxs_port_is_that_ports_to_answer() -> None:
    """`<port>-<id>.<domain>` goes to the sandbox's port alone, with its own
    token (E2B's ports middleware), never to Corral's routes; envd's port
    (49983) and any other name stay refused."""
    port = "http://8000-t-" + "e" * 16 + ".corral.local:7070"
    r = await _get(port, "/v1/sandboxes", headers={"x-access-token": "forged"})
    assert r.status_code != 403 and "loopback" not in r.text  # the port's answer, not ours
    envd = "http://49983-t-" + "e" * 16 + ".corral.local:7070"
    assert (await _get(envd, "/v1/sandboxes")).status_code == 403
