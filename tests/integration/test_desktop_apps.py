"""The full desktop driven the way a computer-use agent drives it: by
screenshots, clicks and keys alone.

Chromium opens a form served from inside the sandbox; the agent finds the
fields on the screen by their colours, clicks and types into them, submits,
and the result is checked on the screen (the page turns green) and in the
page's server log. LibreOffice Calc gets numbers and a formula typed into
it and saves them with ctrl+s; a command checks the saved file. Then four
desktops run at once, each driven to its own state. Each test runs on a
full VM's desktop and on a container's.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

import corral
from corral.api.models import Window
from corral.runtimes.vm import desktop, xfce

from ..framework import png_pixels, require_image

pytestmark = pytest.mark.integration
# A full VM's desktop (QEMU), and a container's (Xvfb): one API, one test.
KINDS = [pytest.param("fullvm", marks=pytest.mark.requires_qemu), "container"]


STEP = 240.0  # s for one step of a GUI under TCG (an app's first start)
FORM = """<!doctype html><html><head><title>Corral form</title><style>
body { margin: 0; background: #ffffff; }
input { position: absolute; left: 60px; width: 360px; height: 56px; border: 0;
        font-size: 28px; }
#name { top: 40px; background: #ff00ff; } #age { top: 140px; background: #00ffff; }
#go { top: 240px; width: 200px; background: #ffff00; }
</style></head><body><form method="post" action="/submit">
<input id="name" name="name"><input id="age" name="age">
<input id="go" type="submit" value="Send"></form></body></html>"""
SERVER = """import http.server, urllib.parse
FORM = open('/tmp/form/index.html', 'rb').read()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header('Content-Type', 'text/html')
        self.end_headers(); self.wfile.write(FORM)
    def do_POST(self):
        body = self.rfile.read(int(self.headers['Content-Length'])).decode()
        with open('/tmp/form/log.txt', 'a') as f:
            f.write(body + '\\n')
        self.send_response(200); self.send_header('Content-Type', 'text/html'); self.end_headers()
        self.wfile.write(b'<html><head><title>Thanks</title></head>'
                         b'<body style="background:#00ff00"></body></html>')
http.server.HTTPServer(('127.0.0.1', 8000), H).serve_forever()
"""
CHECK_ODS = """import os, re, zipfile
x = zipfile.ZipFile('/root/sheet.ods').read('content.xml').decode()
cells = re.findall(r'<table:table-cell[^>]*office:value="([0-9.]+)"', x)
print(os.stat('/root/sheet.ods').st_mtime_ns)
print(' '.join(cells)); print('formula' if 'of:=[.A1]*[.A2]+1' in x else 'no formula')
"""


@pytest.fixture(params=KINDS)
async def xdesk(
    embedded: corral.AsyncClient, request: pytest.FixtureRequest
) -> AsyncIterator[corral.AsyncSandbox]:
    require_image(xfce.BASE)
    s = await embedded.sandboxes.create(
        kind=request.param, image=xfce.BASE, toolkit=[xfce.TOOLKIT], memory="2GiB",
        display_size="1280x800",
    )  # fmt: skip
    try:
        yield s
    finally:
        await s.close()


def _find(rows: list[bytes], rgb: tuple[int, int, int]) -> tuple[int, int, int] | None:
    """(x, y, count): the centre of the pixels of one colour, sampled."""
    target, xs, ys = bytes(rgb), [], []
    for y in range(0, len(rows), 4):
        row = rows[y]
        for x in range(0, len(row) // 3, 4):
            if row[3 * x : 3 * x + 3] == target:
                xs.append(x)
                ys.append(y)
    if len(xs) < 20:
        return None
    return sum(xs) // len(xs), sum(ys) // len(ys), len(xs)


async def _until(
    what: str, probe: Callable[[], Awaitable[object]], timeout: float = STEP
) -> object:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = await probe()
        except corral.Conflict:  # the desktop too busy to answer (an app starting): again
            got = None
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(1)


async def _address(s: corral.AsyncSandbox, url: str, title: str) -> None:
    """Type `url` into the browser's address bar until a page titled
    `title` shows, as an agent that looks does: a browser's window is up
    before its address bar takes keys (a fresh profile under TCG, seen in
    CI: the typed address went nowhere and the page never came)."""
    deadline = time.monotonic() + STEP
    while True:
        await s.display.key("ctrl+l")
        await s.display.type(url + "\n")
        try:
            await _until(f"a window titled *{title}*", lambda: _titled(s, title), 60)
            return
        except AssertionError:
            assert time.monotonic() < deadline, f"{url} never opened a page titled {title}"


async def _still(s: corral.AsyncSandbox, quiet: float = 3.0) -> None:
    """Until the screen has not changed for `quiet` seconds (an app done
    drawing itself), within STEP."""
    deadline = time.monotonic() + STEP
    last, since = b"", time.monotonic()
    while time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, "the screen never stopped changing"
        try:
            shot = await s.display.screenshot(scale=0.25)
        except corral.Conflict:  # too busy to answer: not still
            shot = b""
        if not shot or shot != last:
            last, since = shot, time.monotonic()
        await asyncio.sleep(0.5)


async def _diagnose(s: corral.AsyncSandbox) -> str:
    """What a failed desktop test leaves to read: its screen (a PNG under
    CORRAL_TEST_ARTIFACTS), its X server's view of its input devices, the
    window with the keyboard and the session's processes."""
    out = Path(os.environ.get("CORRAL_TEST_ARTIFACTS", "/tmp/corral-test-artifacts"))
    out.mkdir(parents=True, exist_ok=True)
    shot = out / f"{s.id}.png"
    shot.write_bytes(await s.display.screenshot())
    r = await s.commands.run(
        "grep -iE 'evdev|keyboard|tablet|\\(EE\\)' /var/log/corral-x.log; ls -l /dev/input;"
        " DISPLAY=:0 xdotool getwindowfocus getwindowname; ps -eo pid,stat,etime,args",
        timeout=60,
    )
    return f"screen in {shot}\n{r.stdout}{r.stderr}"


async def _titled(s: corral.AsyncSandbox, part: str) -> bool:
    return any(part in w.title for w in await s.display.windows())


async def _on_screen(s: corral.AsyncSandbox, rgb: tuple[int, int, int]) -> tuple[int, int, int]:
    async def look() -> tuple[int, int, int] | None:
        return _find(png_pixels(await s.display.screenshot())[2], rgb)

    found = await _until(f"colour {rgb} on the screen", look)
    assert isinstance(found, tuple)
    return found


async def _window(s: corral.AsyncSandbox, part: str) -> Window:
    async def look() -> Window | None:
        return next((w for w in await s.display.windows() if part in w.title), None)

    found = await _until(f"a window titled *{part}*", look)
    assert isinstance(found, Window)
    return found


@pytest.mark.timeout(1200)
async def test_an_agent_fills_a_form_in_chromium_and_a_sheet_in_calc(
    xdesk: corral.AsyncSandbox,
) -> None:
    d = xdesk.display
    await xdesk.files.write("/tmp/form/index.html", FORM.encode())
    await xdesk.files.write("/tmp/form/server.py", SERVER.encode())
    await xdesk.commands.start("python3 /tmp/form/server.py")

    # Chromium, the address typed like a person would.
    await d.launch("chromium")
    await _window(xdesk, "Chromium")
    await _address(xdesk, "http://127.0.0.1:8000/", "Corral form")
    # As an agent looks before it types: a field takes its focus when the
    # browser gets to the click (seconds, under TCG).
    x, y, _ = await _on_screen(xdesk, (255, 0, 255))
    await d.click(x, y)
    await d.wait(3)
    await d.type("Ada Lovelace")
    x, y, _ = await _on_screen(xdesk, (0, 255, 255))
    await d.click(x, y)
    await d.wait(3)
    await d.type("36")
    await d.wait(2)
    x, y, _ = await _on_screen(xdesk, (255, 255, 0))
    await d.click(x, y)
    # The result, on the screen and in the server's log.
    _, _, green = await _on_screen(xdesk, (0, 255, 0))
    assert green > 5000  # most of the page
    log = (await xdesk.files.read("/tmp/form/log.txt")).decode()
    assert log.strip() == "name=Ada+Lovelace&age=36"

    # LibreOffice Calc: numbers, a formula, ctrl+s, a path, Enter.
    await d.launch("libreoffice-calc")
    calc = await _window(xdesk, "LibreOffice Calc")
    # Its window is up seconds before it takes keys (toolbars still being
    # built under TCG): wait, as an agent does, until the screen is still.
    await _still(xdesk)

    async def to_a1() -> None:
        # A new window may not have the keyboard (focus stealing
        # prevention): click its title bar, above the client area. Not the
        # sheet: a click there moves the cell cursor, and under load Calc
        # may act on it after the ctrl+home that follows (seen on a full VM
        # in CI: the formula then summed empty cells).
        await d.click(calc.x + calc.width // 2, max(0, calc.y - 8))
        await d.wait(2)
        await d.key("ctrl+home")
        await d.wait(2)
        await _still(xdesk)

    async def sheet(after: str) -> list[str] | None:
        """The saved sheet's [mtime, cells, formula], once a file saved
        since mtime `after` is whole."""
        r = await xdesk.commands.run(["python3", "-c", CHECK_ODS])
        got = r.stdout.split("\n")[:3]
        return got if r.exit_code == 0 and got[0] != after else None

    # As an agent that checks its work: type, save, read the file back, and
    # type and save again if what was typed is not in it. The file decides,
    # not the screen: seen in CI on a full VM, the keys were gone before Calc
    # took them while the grid changed anyway (Calc's first-run infobar came
    # down over it), and an empty sheet was saved. Retyping after ctrl+home
    # writes the same cells, so keys that arrive late do no harm.
    got = ["", "", ""]
    for attempt in range(3):
        await to_a1()
        await d.type("3\n4\n=A1*A2+1\n")
        await _still(xdesk)  # Calc done with the keys it got, before ctrl+s
        await d.key("ctrl+s")
        if attempt == 0:  # a new document: Save asks where
            await _window(xdesk, "Save")
            await d.wait(2)
            await d.key("ctrl+a")
            await d.type("/root/sheet.ods\n")
        try:
            # A sheet unchanged since its last save may not be written
            # again: then this attempt's keys were lost too.
            saved = await _until("the saved sheet", functools.partial(sheet, got[0]), 90)
        except AssertionError:
            continue
        assert isinstance(saved, list)
        got = saved
        if got[1:] == ["3 4 13", "formula"]:
            break
    else:
        raise AssertionError(f"saved: {got!r}; {await _diagnose(xdesk)}")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", KINDS)
async def test_four_desktops_at_once_each_driven_to_its_own_state(
    embedded: corral.AsyncClient, kind: str
) -> None:
    require_image(desktop.BASE)
    colours = ["#ff0000", "#00ff00", "#0000ff", "#ffff00"]
    boxes = await asyncio.gather(
        *(
            embedded.sandboxes.create(
                kind=kind,
                image=desktop.BASE,
                toolkit=[desktop.TOOLKIT],
                memory="1GiB",
                display_size="1024x768",
            )
            for _ in colours
        )
    )
    try:

        async def shows(s: corral.AsyncSandbox, colour: str) -> bool:
            rgb = bytes(int(colour[i : i + 2], 16) for i in (1, 3, 5))
            _, _, rows = png_pixels(await s.display.screenshot())
            return bytes(rows[700][900 * 3 : 900 * 3 + 3]) == rgb

        async def focused(s: corral.AsyncSandbox, term: Window) -> bool:
            """The pointer is inside the terminal and X gives it the keys
            (twm's focus follows the pointer: a click that X got before
            twm had placed the window leaves the pointer elsewhere)."""
            x, y = await s.display.cursor()
            if not (term.x <= x < term.x + term.width and term.y <= y < term.y + term.height):
                return False
            r = await s.commands.run("DISPLAY=:0 xdotool getwindowfocus getwindowname", timeout=30)
            return "xterm" in r.stdout

        async def drive(s: corral.AsyncSandbox, colour: str) -> None:
            await s.display.launch("xterm")
            # As an agent would: look (where the window is now, where the
            # pointer is, who has the keyboard) before it types, and type
            # again if the keys still went nowhere (four desktops load a
            # 2-core host).
            for _ in range(3):
                term = await _window(s, "xterm")
                await s.display.click(term.x + term.width // 2, term.y + term.height // 2)
                try:
                    await _until(
                        "the keyboard on the xterm", functools.partial(focused, s, term), 30
                    )
                except AssertionError:
                    continue
                await s.display.type(f"xsetroot -solid '{colour}'\n")
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    if await shows(s, colour):
                        return
                    await asyncio.sleep(1)
            raise AssertionError(f"{s.id} never showed {colour}: {await _diagnose(s)}")

        await asyncio.gather(*(drive(s, c) for s, c in zip(boxes, colours, strict=True)))
    finally:
        await asyncio.gather(*(s.close() for s in boxes))
