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
from corral.runtimes.vm import display
from corral.runtimes.vm.qemu import MicroVM


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


def test_png_size() -> None:
    assert display.png_size(_png(1280, 800)) == (1280, 800)
    with pytest.raises(ValueError):
        display.png_size(b"GIF89a" + b"\0" * 30)


@pytest.mark.parametrize(
    ("fields", "bad"),
    [
        ({"action": "click", "x": 1}, "y"),
        ({"action": "move", "y": 1}, "x"),
        ({"action": "type"}, "text"),
        ({"action": "key"}, "keys"),
        ({"action": "scroll"}, "action"),
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
        {"kind": "container", "display_size": "800x600"},
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
