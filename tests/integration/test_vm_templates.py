"""Full VM desktops loaded from a template (node/templates.py): the first
create of a spec boots and leaves its drawn desktop as the template; later
creates of the spec load it. Each copy is its own machine: its files, its
kernel randomness (re-keyed on load) and the time now."""

from __future__ import annotations

import time

import pytest

import corral
from corral.runtimes.vm import desktop

from ..framework import Node, png_pixels, require_image

pytestmark = pytest.mark.requires_qemu


async def _uptime(s: corral.AsyncSandbox) -> float:
    return float((await s.commands.run("cut -d' ' -f1 /proc/uptime")).stdout)


async def test_later_desktops_of_a_spec_load_the_first_ones_drawn_template(
    embedded: corral.AsyncClient, node: Node
) -> None:
    require_image(desktop.BASE)
    # A screen size no other test asks for: this test's first create boots.
    spec = {
        "kind": "fullvm", "image": desktop.BASE, "toolkit": [desktop.TOOLKIT],
        "memory": "768MiB", "display_size": "832x624",
    }  # fmt: skip
    templates = node.config.data_dir / "templates"
    before = set(templates.glob("*.state")) if templates.exists() else set()
    first = await embedded.sandboxes.create(**spec)
    made = set(templates.glob("*.state")) - before
    assert len(made) == 1, "the first create of a spec should leave its template"
    copies: list[corral.AsyncSandbox] = []
    try:
        for _ in range(2):
            t0 = time.monotonic()
            s = await embedded.sandboxes.create(**spec)
            copies.append(s)
            # Loaded, not booted: its kernel has been up since the template's
            # boot, longer than this create has taken.
            assert await _uptime(s) > time.monotonic() - t0 + 1.0
            # Drawn at once: its first screenshot is the desktop.
            w, h, rows = png_pixels(await s.display.screenshot())
            assert (w, h) == (832, 624)
            assert rows[h - 10][3 * 10 : 3 * 10 + 3] == bytes(desktop.DESKTOP_RGB)
            # The wall clock is now, not when the template was saved.
            now = float((await s.commands.run("date +%s")).stdout)
            assert abs(now - time.time()) < 5
        # Each copy's files are its own.
        await copies[0].files.write("/tmp/mine", b"0")
        assert not (await copies[1].commands.run("test -e /tmp/mine")).ok
        assert not (await first.commands.run("test -e /tmp/mine")).ok
        # Their kernels' random numbers differ (the CRNG re-keyed on load).
        draws = [
            (await s.commands.run("head -c 16 /dev/urandom | od -An -tx1")).stdout for s in copies
        ]
        assert draws[0] != draws[1]
    finally:
        for s in [first, *copies]:
            await s.close()


async def test_a_template_that_does_not_load_is_dropped_and_made_again(
    embedded: corral.AsyncClient, node: Node
) -> None:
    require_image(desktop.BASE)
    spec = {
        "kind": "fullvm", "image": desktop.BASE, "toolkit": [desktop.TOOLKIT],
        "memory": "640MiB", "display_size": "848x640",
    }  # fmt: skip
    templates = node.config.data_dir / "templates"
    before = set(templates.glob("*.state")) if templates.exists() else set()
    await (await embedded.sandboxes.create(**spec)).close()
    [made] = set(templates.glob("*.state")) - before
    made.write_bytes(b"not a machine state")  # as a QEMU upgrade or a bad disk would leave it
    leftovers = node.leftovers()
    with pytest.raises(corral.SandboxFailed):
        await embedded.sandboxes.create(**spec)
    assert not made.exists(), "a template that did not load must not be tried again"
    assert node.leftovers() == leftovers
    again = await embedded.sandboxes.create(**spec)  # boots, and saves it anew
    try:
        assert made.exists() and made.stat().st_size > 1 << 20
        assert (await again.commands.run("true")).ok
    finally:
        await again.close()
