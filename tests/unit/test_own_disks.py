"""Users' own disks: what is refused as a disk, how they are named and
copied in, and when a screen with no agent behind it counts as drawn."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from corral.api.models import CreateSandbox
from corral.control import project_images
from corral.errors import Conflict, InvalidArgument, SandboxFailed
from corral.images import disks
from corral.runtimes import drawn
from corral.runtimes.vm import pixels

needs_qemu_img = pytest.mark.skipif(
    shutil.which("qemu-img") is None, reason="requires qemu-img (apt install qemu-utils)"
)


def _boot_sector(path: Path, size: int = 1 << 20) -> Path:
    with open(path, "wb") as f:
        f.truncate(size)
        f.seek(510)
        f.write(disks.BOOT_SIGNATURE)
        f.seek(size // 2)
        f.write(b"data in the middle")  # the rest stays a hole
    return path


@pytest.mark.parametrize(
    "ref",
    ["disk:", "disk:a/b", "disk:../x", "disk:.hidden", "disk:" + "x" * 65, "disk:a b",
     "disk:projects/Acme/x", "disk:projects/a/../x", "disk:projects/a/b/c", "disk:projects//x",
     "disk:projects/a/", "disk:projects/../x", "disk:projects/-a/x", "disk:projects"],
)  # fmt: skip
def test_bad_disk_names(ref: str) -> None:
    with pytest.raises(InvalidArgument) as exc:
        disks.disk_name(ref)
    assert exc.value.field == "image" and "1-64 letters" in exc.value.rule


@needs_qemu_img
def test_what_is_not_a_disk(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("hello\n")
    short = tmp_path / "short.img"
    short.write_bytes(b"\0" * 100)
    chained = tmp_path / "chained.qcow2"
    subprocess.run(
        ["qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", str(text), str(chained)],
        check=True,
    )
    vmdk = tmp_path / "other.vmdk"
    subprocess.run(["qemu-img", "create", "-q", "-f", "vmdk", str(vmdk), "1M"], check=True)
    for path, rule in [
        (text, "boot sector"),
        (short, "boot sector"),
        (chained, "backing file"),
        (vmdk, "not 'vmdk'"),
        (tmp_path, "regular file"),
        (tmp_path / "absent", "regular file"),
    ]:
        with pytest.raises(InvalidArgument) as exc:
            disks.inspect(path)
        assert exc.value.field == "path" and rule in exc.value.rule, exc.value.rule
        assert str(path) in str(exc.value)


@needs_qemu_img
def test_a_disk_is_copied_in_whole_read_only_with_its_holes(tmp_path: Path) -> None:
    source = _boot_sector(tmp_path / "src.img", 64 << 20)
    store = disks.Disks(tmp_path / "disks")
    seen: list[tuple[int, int]] = []
    disk = store.add(source, "mine", lambda done, total: seen.append((done, total)))
    assert (disk.name, disk.format, disk.virtual_size) == ("mine", "raw", 64 << 20)
    assert disk.path.read_bytes() == source.read_bytes()
    assert disk.path.stat().st_mode & 0o777 == 0o444
    assert disk.path.stat().st_blocks * 512 < 8 << 20, "the holes should stay holes"
    assert seen[-1] == (64 << 20, 64 << 20)
    assert [d.name for d in store.list()] == ["mine"]
    assert store.get("disk:mine") == disk
    with pytest.raises(Conflict):
        store.add(source, "mine")
    with pytest.raises(InvalidArgument) as exc:
        store.add(tmp_path / "disks" / "mine", "../escape")
    assert exc.value.field == "name"
    store.remove("disk:mine")
    assert store.list() == []
    with pytest.raises(InvalidArgument) as exc:
        store.get("disk:mine")
    assert "corral disk add" in exc.value.rule
    assert not list((tmp_path / "disks").iterdir())


@needs_qemu_img
def test_a_projects_own_disk_is_named_under_it(tmp_path: Path) -> None:
    source = _boot_sector(tmp_path / "src.img")
    store = disks.Disks(tmp_path / "disks")
    store.add(source, "shared")
    disk = store.add(source, "projects/acme/win11")
    assert disk.path == tmp_path / "disks" / "projects" / "acme" / "win11"
    assert [d.name for d in store.list()] == ["projects/acme/win11", "shared"]
    assert store.get("disk:projects/acme/win11") == disk
    with pytest.raises(InvalidArgument, match="names no disk"):
        store.get("disk:projects/other/win11")
    store.remove("disk:projects/acme/win11")
    assert [d.name for d in store.list()] == ["shared"]
    assert not list((tmp_path / "disks" / "projects" / "acme").iterdir())


@pytest.mark.parametrize(
    ("image", "allowed"),
    [
        ("disk:win11", True),  # the operator's: every project's
        ("disk:projects/acme/win11", True),
        ("disk:projects/rival/win11", False),
        ("disk:projects/acme-x/win11", False),
        ("projects/rival/img:1", False),
    ],
)
def test_a_gateway_boots_a_projects_own_disk_for_it_alone(image: str, allowed: bool) -> None:
    req = CreateSandbox(kind="fullvm", image=image) if image.startswith("disk:") else None
    req = req or CreateSandbox(image=image)
    if allowed:
        project_images.check_create("acme", req)
        return
    with pytest.raises(InvalidArgument, match="another project's images or disks") as err:
        project_images.check_create("acme", req)
    assert err.value.field == "image" and image in str(err.value)


class Frames:
    """A screen that shows a list of frames, then the last one forever."""

    def __init__(self, frames: list[pixels.Rgb]) -> None:
        self.frames = frames

    async def frame(self) -> pixels.Rgb:
        return self.frames.pop(0) if len(self.frames) > 1 else self.frames[0]


def _screen(lit_rows: range, w: int = 64, h: int = 64) -> pixels.Rgb:
    rows = [(b"\xff" * 3 * w if y in lit_rows else b"\0" * 3 * w) for y in range(h)]
    return pixels.Rgb(w, h, b"".join(rows))


async def test_a_screen_that_holds_still_but_for_a_cursor_is_drawn(monkeypatch: object) -> None:
    menu, blink = _screen(range(0, 40)), _screen(range(0, 48))  # 8 rows: a cursor
    screen = Frames([_screen(range(0)), menu, blink, menu, blink, menu])
    await drawn.wait_still("s", screen, quiet=0.5, timeout=10)


async def test_a_screen_that_never_settles_or_stays_black_fails_naming_why() -> None:
    black = Frames([_screen(range(0))])
    with pytest.raises(SandboxFailed, match="one colour"):
        await drawn.wait_still("s", black, quiet=0.2, timeout=1)

    class Moving:
        n = 0

        async def frame(self) -> pixels.Rgb:
            self.n += 1
            return _screen(range(0, 30) if self.n % 2 else range(30, 64))

    with pytest.raises(SandboxFailed, match="kept changing"):
        await drawn.wait_still("s", Moving(), quiet=0.5, timeout=1.5)


def test_rows_changed() -> None:
    a, b = _screen(range(0, 10)), _screen(range(0, 12))
    assert pixels.rows_changed(a, a) == 0
    assert pixels.rows_changed(a, b) == 2
    assert pixels.rows_changed(a, _screen(range(0), 32, 32)) == 64
