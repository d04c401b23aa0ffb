"""The dashboard in a real browser: headless Chromium, driven by Selenium,
against a `corral serve` with an API key and real sandboxes (running,
suspended, closed; one with commands, one of them failing).

Each page's screenshot is saved to build/artefacts/dashboard/<page>.png.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

import corral
from corral.config import NodeConfig

from ..framework import IMAGE, Node
from ..framework.browser import chromium

pytestmark = pytest.mark.integration

KEY = "dashboard-test-key"
EVIL = "<script>window.pwned=1</script>"
ARTEFACTS = Path(__file__).resolve().parents[2] / "build" / "artefacts" / "dashboard"


@dataclass
class Site:
    node: Node
    url: str
    worker: str  # running, with commands (one failing) and a hostile label
    spare: str  # running: the live-update test suspends it
    suspended: str
    closed: str


async def _populate(node: Node) -> dict[str, str]:
    async with corral.AsyncClient(node.server.url, api_key=KEY) as c:
        worker = await c.sandboxes.create(image=IMAGE, labels={"role": "worker", "evil": EVIL})
        ok = await worker.commands.run("echo hello-dashboard")
        bad = await worker.commands.run("echo oops >&2; exit 3")
        assert (ok.exit_code, bad.exit_code) == (0, 3)
        spare = await c.sandboxes.create(image=IMAGE, labels={"role": "spare"})
        sleeper = await c.sandboxes.create(image=IMAGE, labels={"role": "sleeper"})
        await sleeper.suspend()
        gone = await c.sandboxes.create(image=IMAGE, labels={"role": "gone"})
        await gone.close()
        return {"worker": worker.id, "spare": spare.id, "suspended": sleeper.id, "closed": gone.id}


async def _close_all(node: Node) -> None:
    async with corral.AsyncClient(node.server.url, api_key=KEY) as c:
        await asyncio.gather(*(s.close() for s in await c.sandboxes.list()))


@pytest.fixture(scope="module")
def site(node_config: NodeConfig, data_root: Path) -> Iterator[Site]:
    config = replace(node_config, data_dir=data_root / "ui", node="ui")
    node = Node(config, serve_env={"CORRAL_API_KEY": KEY})
    node.server.start()
    try:
        ids = asyncio.run(_populate(node))
        yield Site(node, node.server.tcp_url, **ids)
    finally:
        try:
            asyncio.run(_close_all(node))
        finally:
            node.server.stop()
            node.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with chromium((1400, 2400)) as b:
        ARTEFACTS.mkdir(parents=True, exist_ok=True)
        yield b


def _wait(what: str, ok: Callable[[], bool], timeout: float = 45.0) -> None:
    # 45 s, not 15: in the full suite a navigation once took longer than 15 s
    # on this 2-core host (Chromium and the node share it with the suite).
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _text(b: Any, css: str) -> str:
    from selenium.webdriver.common.by import By

    return str(b.find_element(By.CSS_SELECTOR, css).text)


def _shot(b: Any, name: str) -> None:
    assert b.save_screenshot(str(ARTEFACTS / f"{name}.png"))


def _login(b: Any, site: Site, key: str) -> None:
    from selenium.webdriver.common.by import By

    b.get(site.url + "/ui")
    form = b.find_element(By.ID, "login")
    b.find_element(By.ID, "key").send_keys(key)
    b.find_element(By.ID, "login-submit").click()
    # click() does not wait for the page it posts to: the form going stale does.
    _wait("the login's answer", lambda: _stale(form))


def _stale(element: Any) -> bool:
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException

    try:
        element.is_enabled()
    except StaleElementReferenceException:
        return True
    except WebDriverException as exc:
        # Mid-navigation Chromium may say so in its own words (CI saw it once).
        if "does not belong to the document" in str(exc):
            return True
        raise
    return False


# ---------------------------------------------------------------- tests (in order)


def test_a_bad_key_is_refused(site: Site, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    browser.delete_all_cookies()
    browser.get(site.url + "/ui")
    assert browser.find_elements(By.ID, "login") and site.worker not in browser.page_source
    _shot(browser, "login")
    _login(browser, site, "not-the-key")
    assert "that key was refused" in _text(browser, "#login-error")
    assert site.worker not in browser.page_source
    assert not browser.get_cookies()
    # Without a browser: a wrong header is a 401 too, and the cookie of a
    # good key never authenticates a write.
    r = httpx.get(site.url + "/ui", headers={"authorization": "Bearer nope"})
    assert r.status_code == 401 and 'id="login"' in r.text
    r = httpx.post(site.url + "/v1/sandboxes", json={"image": IMAGE}, cookies={"corral_key": KEY})
    assert r.status_code == 401, r.text


def test_login_then_the_list_shows_every_sandbox_with_its_state(site: Site, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    _login(browser, site, KEY)
    _wait("the list", lambda: bool(browser.find_elements(By.ID, "sandboxes")))
    cookie = browser.get_cookie("corral_key")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
    states = {
        row.get_attribute("data-sandbox"): row.find_element(By.CSS_SELECTOR, ".state").text
        for row in browser.find_elements(By.CSS_SELECTOR, "tr[data-sandbox]")
    }
    assert states[site.worker] == "running" and states[site.spare] == "running"
    assert states[site.suspended] == "suspended"
    assert states[site.closed] == "closed"
    counts = {
        el.get_attribute("data-count"): int(el.text)
        for el in browser.find_elements(By.CSS_SELECTOR, "[data-count]")
    }
    assert counts["state:running"] == 2 and counts["state:suspended"] == 1
    assert counts["state:closed"] == 1 and counts["kind:container"] == 4
    assert _text(browser, "#total") == "4 sandboxes"
    # The hostile label is text on the page, never a script that ran.
    assert f"evil={EVIL}" in browser.find_element(By.ID, "sandboxes").text
    assert browser.execute_script("return window.pwned === undefined")
    _shot(browser, "sandboxes")


def test_filters_narrow_the_list(site: Site, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    def shown() -> set[str]:
        rows = browser.find_elements(By.CSS_SELECTOR, "tr[data-sandbox]")
        return {r.get_attribute("data-sandbox") for r in rows}

    browser.get(site.url + "/ui?state=suspended")
    assert shown() == {site.suspended}
    browser.get(site.url + "/ui?label=role%3Dworker")
    assert shown() == {site.worker}
    browser.get(site.url + "/ui?q=" + site.closed[-6:])
    assert shown() == {site.closed}
    _shot(browser, "sandboxes-filtered")


def test_a_row_leads_to_its_commands_timeline_report_and_usage(site: Site, browser: Any) -> None:
    from selenium.webdriver.common.by import By

    browser.get(site.url + "/ui")
    row = browser.find_element(By.CSS_SELECTOR, f'tr[data-sandbox="{site.worker}"]')
    row.find_element(By.CSS_SELECTOR, "a.sbx").click()
    _wait("the detail page", lambda: bool(browser.find_elements(By.ID, "commands")))
    assert site.worker in browser.title
    commands = [
        [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
        for tr in browser.find_elements(By.CSS_SELECTOR, "#commands tbody tr")
    ]
    by_command = {c[1]: c for c in commands}
    ok = next(c for cmd, c in by_command.items() if "hello-dashboard" in cmd)
    bad = next(c for cmd, c in by_command.items() if "exit 3" in cmd)
    assert ok[4] == "0" and bad[4] == "3"
    timeline = browser.find_element(By.ID, "timeline").text
    assert "created" in timeline and "exit 3" in timeline
    assert _text(browser, "#verdict").startswith("verdict:")
    assert browser.find_elements(By.CSS_SELECTOR, "#verdict .badge")
    assert "debian-python:bookworm" in browser.find_element(By.CSS_SELECTOR, "table.kv").text
    # Usage is polled from the API by script, on the same cookie.
    _wait("usage", lambda: "memory" in _text(browser, "#usage-now"))
    _wait(
        "a second sample",
        lambda: bool(browser.find_elements(By.CSS_SELECTOR, "#usage svg polyline")),
    )
    _shot(browser, "sandbox")


def test_a_closed_sandboxs_page_still_has_its_spec(site: Site, browser: Any) -> None:
    browser.get(f"{site.url}/ui/sandboxes/{site.closed}")
    assert "closed" in _text(browser, "table.kv")
    browser.get(f"{site.url}/ui/sandboxes/ui-0000000000000000")
    assert "Not found" in _text(browser, "h1")


def test_state_changes_arrive_live_and_other_events_ask_for_a_refresh(
    site: Site, browser: Any
) -> None:
    from selenium.webdriver.common.by import By

    browser.get(site.url + "/ui")
    badge = f'tr[data-sandbox="{site.spare}"] .state .badge'
    assert _text(browser, badge) == "running"
    time.sleep(1.0)  # the page's EventSource connects

    async def suspend_and_create() -> None:
        async with corral.AsyncClient(site.node.server.url, api_key=KEY) as c:
            await (await c.sandboxes.get(site.spare)).suspend()
            await c.sandboxes.create(image=IMAGE, labels={"role": "late"})

    asyncio.run(suspend_and_create())
    _wait("the live state", lambda: _text(browser, badge) == "suspended")
    hint = browser.find_element(By.ID, "live-hint")
    _wait("the refresh hint", lambda: "new events, refresh" in hint.text)
    _shot(browser, "sandboxes-live")


def test_the_node_projects_and_metrics_pages(site: Site, browser: Any) -> None:
    browser.get(site.url + "/ui/nodes")
    nodes = _text(browser, "#nodes")
    assert "ui" in nodes and "alive" in nodes
    assert "PSI not available" in nodes or "some" in nodes
    _shot(browser, "nodes")
    browser.get(site.url + "/ui/projects")
    assert "no projects" in _text(browser, "#projects")
    _shot(browser, "projects")
    browser.get(site.url + "/ui/metrics")
    created = _text(browser, "#created")
    assert int(created.split()[0]) >= 5, created  # this server made 5 sandboxes
    assert "create (node): p50" in browser.page_source
    _shot(browser, "metrics")
