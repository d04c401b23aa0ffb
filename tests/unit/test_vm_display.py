"""Full-VM parts that need no QEMU: input checks, key maps, the command line."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any

import pytest

from corral.api.models import (
    CreateSandbox,
    DisplayInput,
    ForkRequest,
    SavedState,
    SaveRequest,
    validated,
)
from corral.errors import InvalidArgument
from corral.runtimes.vm import display, pixels
from corral.runtimes.vm.qemu import OVMF_CODE, DiskVM, MicroVM


def _png(w: int, h: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return (
        b"\x89PNG\r\n\x1a\n"
        + struct.pack(">I", len(ihdr))
        + chunk
        + struct.pack(">I", zlib.crc32(chunk))
    )


@pytest.mark.parametrize(
    ("ch", "keys"),
    [
        ("a", ["a"]),
        ("Z", ["shift", "z"]),
        ("7", ["7"]),
        ("$", ["shift", "4"]),
        (" ", ["spc"]),
        ("\n", ["ret"]),
        ('"', ["shift", "apostrophe"]),
        ("|", ["shift", "backslash"]),
    ],
)
def test_characters_map_to_us_keys(ch: str, keys: list[str]) -> None:
    assert display.char_keys(ch) == keys


@pytest.mark.parametrize(
    ("combo", "keys"),
    [
        ("ctrl+c", ["ctrl", "c"]),
        ("Ctrl+Alt+T", ["ctrl", "alt", "t"]),
        ("enter", ["ret"]),
        ("shift+A", ["shift", "a"]),
        ("super", ["meta_l"]),
        ("+", ["shift", "equal"]),
        ("f12", ["f12"]),
        # xdotool's names (Anthropic's `key`) and browser names (OpenAI's `keypress`)
        ("alt+Tab", ["alt", "tab"]),
        ("Return", ["ret"]),
        ("KP_0", ["kp_0"]),
        ("Page_Down", ["pgdn"]),
        ("super_l", ["meta_l"]),
        ("CTRL+ArrowLeft", ["ctrl", "left"]),
        ("ctrl+bracketleft", ["ctrl", "bracket_left"]),
    ],
)
def test_key_combinations(combo: str, keys: list[str]) -> None:
    assert display.combo_keys(combo) == keys


@pytest.mark.parametrize(
    ("field", "call"),
    [
        ("text", lambda: display.char_keys("é")),
        ("text", lambda: display.char_keys("\x00")),
        ("keys", lambda: display.combo_keys("")),
        ("keys", lambda: display.combo_keys("ctrl+")),
        ("keys", lambda: display.combo_keys("ctrl+banana")),
    ],
)
def test_bad_keys_name_the_field(field: str, call: Any) -> None:
    with pytest.raises(InvalidArgument) as e:
        call()
    assert e.value.field == field


async def test_clicks_outside_the_screen_are_refused_before_qemu(tmp_path: Path) -> None:
    # No QMP socket exists: a refusal must come before any connection.
    d = display.Display(tmp_path / "none.sock", tmp_path / "s.png", (1024, 768))
    for x, y, field in [(-1, 0, "x"), (1024, 0, "x"), (0, 768, "y"), (5, -3, "y")]:
        with pytest.raises(InvalidArgument) as e:
            await d.click(x, y)
        assert e.value.field == field
    with pytest.raises(InvalidArgument, match="button"):
        await d.click(1, 1, button="thumb")
    with pytest.raises(InvalidArgument, match="text"):
        await d.type("x" * (display.MAX_TEXT + 1))
    with pytest.raises(InvalidArgument, match="text"):
        await d.type("ok then ünicode")
    bad: list[tuple[str, Any]] = [
        ("path", lambda: d.drag([(1, 1)])),
        ("x", lambda: d.drag([(1, 1), (2000, 1)])),
        ("dy", lambda: d.scroll(0, 0)),
        ("dx", lambda: d.scroll(99, 0)),
        ("y", lambda: d.scroll(0, 1, 5, None)),
        ("button", lambda: d.button("thumb", True)),
        ("keys", lambda: d.hold("hyper", True)),
        ("percent", lambda: d.screenshot(percent=4)),
        ("width", lambda: d.screenshot(region=pixels.Region(1000, 0, 25, 10))),
        ("height", lambda: d.screenshot(region=pixels.Region(0, 0, 10, 0))),
    ]
    for field, call in bad:
        with pytest.raises(InvalidArgument) as e:
            await call()
        assert e.value.field == field


def test_a_full_vm_types_each_key_down_then_up_on_its_own_clock() -> None:
    # Not QEMU's send-key, whose bounded queue drops keys under load: each
    # key goes down, is held, goes up (shift last), then a gap.
    shift_a = ("send-key", display._send_key(display.char_keys("A")))
    click = display._btn("left", True)
    played = list(display._paced((shift_a, click)))
    assert [name for name, _ in played] == [
        "input-send-event", display.PAUSE, "input-send-event", display.PAUSE, "input-send-event"
    ]  # fmt: skip

    def keys(i: int) -> list[tuple[bool, object]]:
        events: Any = played[i][1]["events"]
        return [(e["data"]["down"], e["data"]["key"]["data"]) for e in events]

    assert keys(0) == [(True, "shift"), (True, "a")]
    assert keys(2) == [(False, "a"), (False, "shift")]
    assert played[1][1]["s"] == display.KEY_HOLD_MS / 1000
    assert played[3][1]["s"] == display.KEY_GAP_MS / 1000
    assert played[4] == click


def test_png_size() -> None:
    assert pixels.png_size(_png(1280, 800)) == (1280, 800)
    with pytest.raises(ValueError):
        pixels.png_size(b"GIF89a" + b"\0" * 30)


@pytest.mark.parametrize(
    ("fields", "bad"),
    [
        ({"action": "click", "x": 1}, "y"),
        ({"action": "move", "y": 1}, "x"),
        ({"action": "type"}, "text"),
        ({"action": "key"}, "keys"),
        ({"action": "scroll"}, "dy"),
        ({"action": "scroll", "dy": 51}, "dy"),
        ({"action": "scroll", "dx": -51}, "dx"),
        ({"action": "drag"}, "path"),
        ({"action": "drag", "path": [[1, 1]]}, "path"),
        ({"action": "drag", "path": [[1, 1]] * 65}, "path"),
        ({"action": "key_down"}, "keys"),
        ({"action": "click", "x": 1}, "y"),
        ({"action": "button_down", "y": 4}, "x"),
        ({"action": "wiggle"}, "action"),
        ({"action": "click", "x": 1, "y": 1, "count": 4}, "count"),
        ({"action": "click", "x": 1, "y": 1, "button": "thumb"}, "button"),
        ({"action": "type", "text": "x" * 4097}, "text"),
        ({"action": "key", "keys": "k", "extra": 1}, "extra"),
    ],
)
def test_display_input_table(fields: dict[str, Any], bad: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        validated(DisplayInput, fields)
    assert e.value.field == bad


def test_fullvm_defaults_and_display_size() -> None:
    req = validated(CreateSandbox, {"kind": "fullvm", "image": "a:b"})
    assert (req.cpu, req.memory, req.display_size) == (2.0, 2 * 2**30, (1024, 768))
    req = validated(CreateSandbox, {"kind": "fullvm", "image": "a:b", "memory": "1GiB"})
    assert req.memory == 2**30  # asked for: kept
    req = validated(CreateSandbox, {"kind": "fullvm", "image": "a:b", "display_size": "1280x800"})
    assert req.display_size == (1280, 800)
    assert validated(CreateSandbox, {"kind": "container", "image": "a:b"}).memory == 2**30


@pytest.mark.parametrize(
    "fields",
    [
        {"kind": "fncall", "display_size": "800x600"},
        {"kind": "container", "display_size": "10x10"},
        {"kind": "microvm", "display_size": "800x600"},
        {"kind": "fullvm", "display_size": "100x100"},
        {"kind": "fullvm", "display_size": "4096x2160"},
        {"kind": "fullvm", "display_size": "big"},
        {"kind": "fullvm", "display_size": [1, 2, 3]},
    ],
)
def test_bad_display_sizes(fields: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument) as e:
        validated(CreateSandbox, {"image": "a:b", **fields})
    assert e.value.field == "display_size"


def _vm(**kw: Any) -> MicroVM:
    p = Path("/x")
    return MicroVM(kernel=p, initrd=p, agent_socket=p, console_log=p, qmp_socket=p, **kw)


def test_a_full_vm_is_q35_with_pci_devices_a_screen_and_input(monkeypatch: Any) -> None:
    monkeypatch.setattr("corral.runtimes.vm.qemu.qemu_binary", lambda: "qemu")
    micro = " ".join(_vm().argv())
    assert "microvm" in micro and "-pci" not in micro and "VGA" not in micro
    full = " ".join(_vm(display=(1280, 800)).argv())
    assert "-M q35" in full
    assert "VGA,edid=on,xres=1280,yres=800" in full
    assert "virtio-tablet-pci" in full and "virtio-keyboard-pci" in full
    assert "virtio-serial-pci" in full and "virtio-serial-device" not in full


def test_a_nic_is_a_tap_and_pmem_needs_q35(monkeypatch: Any, tmp_path: Path) -> None:
    monkeypatch.setattr("corral.runtimes.vm.qemu.qemu_binary", lambda: "qemu")
    micro = " ".join(_vm(tap="tap0").argv())
    assert "-netdev tap,id=n0,ifname=tap0,script=no,downscript=no" in micro
    assert "virtio-net-device,netdev=n0" in micro
    image = tmp_path / "base.erofs"
    image.write_bytes(b"\0" * 4096)
    with pytest.raises(ValueError, match="q35"):
        _vm(pmem=image).argv()
    full = " ".join(_vm(pmem=image, display=(800, 600), memory_mib=512).argv())
    assert f"mem-path={image}" in full and "readonly=on" in full
    assert "virtio-pmem-pci" in full and "swiotlb=noforce" in full and "maxmem=" in full


@pytest.mark.parametrize(
    ("model", "fields", "bad"),
    [
        (ForkRequest, {"n": 0}, "n"),
        (ForkRequest, {"n": 33}, "n"),
        (ForkRequest, {"n": 2, "idempotency_keys": ["a"]}, "idempotency_keys"),
        (ForkRequest, {"n": 2, "idempotency_keys": ["a", "a"]}, "idempotency_keys"),
        (ForkRequest, {"n": 1, "idempotency_keys": ["no spaces"]}, "idempotency_keys"),
        (SaveRequest, {"store": ""}, "store"),
        (SaveRequest, {"store": "/var/lib/x"}, "store"),  # a path: stores are named
        (SaveRequest, {"store": "http://169.254.169.254/"}, "store"),
        (SaveRequest, {"store": "s3://bucket/x"}, "store"),
        (SaveRequest, {"store": "A" * 33}, "store"),
        (SavedState, {"store": "local", "key": "../etc/passwd"}, "key"),
        (SavedState, {"store": "local", "key": "vmstates/t-0123"}, "key"),
        (SavedState, {"store": "local", "key": "vmstates/t-0123456789abcdef", "x": 1}, "x"),
        (SavedState, {"store": "/s", "key": "vmstates/t-0123456789abcdef"}, "store"),
        (SavedState, {"key": "vmstates/t-0123456789abcdef", "memory": -1}, "memory"),
    ],
)
def test_fork_save_and_restore_requests_table(model: Any, fields: dict[str, Any], bad: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        validated(model, fields)
    assert e.value.field == bad


def test_a_store_must_be_absolute_or_a_url() -> None:
    from corral.images.objects import open_store

    with pytest.raises(InvalidArgument) as e:
        open_store("relative/dir")
    assert e.value.field == "store"


def test_saved_states_are_signed_over_their_name_and_record(tmp_path: Path) -> None:
    from corral.node import signing as states

    path = tmp_path / "keys" / "state.key"
    key = states.load_key(path)
    assert len(key) == 32 and path.stat().st_mode & 0o777 == 0o600
    assert states.load_key(path) == key  # made once, then read
    mac = states.sign(key, "vmstates/a-0123456789abcdef", b'{"spec": 1}')
    assert states.verify(key, "vmstates/a-0123456789abcdef", b'{"spec": 1}', mac)
    assert not states.verify(key, "vmstates/a-0123456789abcdef", b'{"spec": 2}', mac)
    assert not states.verify(key, "vmstates/b-0123456789abcdef", b'{"spec": 1}', mac)
    assert not states.verify(b"x" * 32, "vmstates/a-0123456789abcdef", b'{"spec": 1}', mac)
    assert not states.verify(key, "vmstates/a-0123456789abcdef", b'{"spec": 1}', "00")


def _rgb(w: int, h: int) -> pixels.Rgb:
    """Pixel (x, y) is (x, y, 7): where a pixel came from is in its value."""
    return pixels.Rgb(w, h, bytes(v for y in range(h) for x in range(w) for v in (x, y, 7)))


def _ppm(image: pixels.Rgb) -> bytes:
    return b"P6\n# QEMU\n%d %d\n255\n" % (image.width, image.height) + image.data


def test_ppm_parses_cuts_and_scales() -> None:
    image = pixels.parse_ppm(_ppm(_rgb(40, 30)))
    assert (image.width, image.height) == (40, 30)
    part = pixels.cut(image, pixels.Region(5, 6, 10, 4))
    assert (part.width, part.height) == (10, 4)
    assert part.row(0)[:6] == bytes([5, 6, 7, 6, 6, 7]) and part.row(3)[-3:] == bytes([14, 9, 7])
    half = pixels.scaled(image, 50)
    assert (half.width, half.height) == (20, 15)
    # Nearest pixel: output (i, j) comes from source (2i + 1, 2j + 1).
    assert half.row(0)[:3] == bytes([1, 1, 7]) and half.row(14)[-3:] == bytes([39, 29, 7])
    assert pixels.scaled(image, 100) is image
    tiny = pixels.scaled(pixels.Rgb(1, 1, b"abc"), 5)
    assert (tiny.width, tiny.height, tiny.data) == (1, 1, b"abc")
    for bad in (b"P5\n1 1\n255\n\0", b"P6\n2 2\n255\n\0\0", b"P6\n", b"P6 1 1 65535\n\0\0"):
        with pytest.raises(ValueError):
            pixels.parse_ppm(bad)


def test_png_round_trip_and_colour_count() -> None:
    image = _rgb(33, 17)
    data = pixels.png(image)
    assert pixels.png_size(data) == (33, 17)
    ihdr_end = 8 + 8 + 13 + 4
    idat_len = struct.unpack(">I", data[ihdr_end : ihdr_end + 4])[0]
    raw = zlib.decompress(data[ihdr_end + 8 : ihdr_end + 8 + idat_len])
    rows = [raw[y * (1 + 33 * 3) : (y + 1) * (1 + 33 * 3)] for y in range(17)]
    assert all(r[0] == 0 for r in rows) and b"".join(r[1:] for r in rows) == image.data
    black = pixels.Rgb(64, 48, bytes(64 * 48 * 3))
    assert pixels.distinct_colours(black, 2) == 1
    assert pixels.distinct_colours(image, 2) == 2


@pytest.mark.parametrize(
    ("region", "field"),
    [
        (pixels.Region(-1, 0, 1, 1), "x"),
        (pixels.Region(0, 768, 1, 1), "y"),
        (pixels.Region(1000, 0, 25, 1), "width"),
        (pixels.Region(0, 0, 1, 0), "height"),
        (pixels.Region(0, 700, 1, 69), "height"),
    ],
)
def test_bad_regions_name_the_field(region: pixels.Region, field: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        region.check((1024, 768))
    assert e.value.field == field


def test_an_own_disk_boots_its_firmware_on_devices_every_os_drives(
    monkeypatch: Any, tmp_path: Path
) -> None:
    monkeypatch.setattr("corral.runtimes.vm.qemu.qemu_binary", lambda: "qemu")
    p = tmp_path
    bios = DiskVM(p / "o.qcow2", p / "c.log", p / "q.sock", p / "v.sock", (1280, 800)).argv()
    line = " ".join(bios)
    assert "-kernel" not in line and "virtio" not in line and "pflash" not in line
    # The overlay's format is stated: a raw disk is never probed into a qcow2.
    assert f"file={p / 'o.qcow2'},if=none,id=disk0,format=qcow2" in line
    assert "ide-hd,drive=disk0" in line and "usb-tablet" in line
    assert "VGA,edid=on,xres=1280,yres=800" in line and "-sandbox" in line
    uefi = " ".join(
        DiskVM(p / "o", p / "c", p / "q", p / "v", (800, 600), vars=p / "vars.fd").argv()
    )
    assert f"readonly=on,file={OVMF_CODE}" in uefi and f"unit=1,file={p / 'vars.fd'}" in uefi
