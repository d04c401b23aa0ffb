"""Sandbox directories parked at close and taken at create
(node/sandboxdirs.py): nothing of one sandbox reaches the next."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from corral.node.sandboxdirs import LOG, SandboxDirs


@pytest.fixture
def dirs(tmp_path: Path) -> SandboxDirs:
    (tmp_path / "sandboxes").mkdir()
    return SandboxDirs(tmp_path / "sandboxes", tmp_path / "spare", keep=2)


def _used(d: Path) -> None:
    (d / LOG).write_text('{"event": "state"}\n')
    (d / "checkpoint").mkdir()
    (d / "checkpoint" / "pages.img").write_bytes(b"x" * 100)
    (d / "fork-1.state").write_bytes(b"y")


def test_a_closed_sandboxs_dir_is_parked_empty_and_taken_by_the_next(dirs: SandboxDirs) -> None:
    first = dirs.make("n-1", mode=0o711)
    assert stat.S_IMODE(first.stat().st_mode) == 0o711
    _used(first)
    inode = first.stat().st_ino
    dirs.remove(str(first))
    assert not first.exists()
    assert os.listdir(dirs.spare) == ["n-1"]
    assert os.listdir(dirs.spare / "n-1") == [LOG]
    assert (dirs.spare / "n-1" / LOG).stat().st_size == 0
    second = dirs.make("n-2", mode=0o700)
    assert second.stat().st_ino == inode  # no new inode
    assert stat.S_IMODE(second.stat().st_mode) == 0o700
    assert os.listdir(second) == [LOG] and (second / LOG).read_bytes() == b""
    assert os.listdir(dirs.spare) == []


def test_a_line_written_after_parking_does_not_reach_the_next_log(dirs: SandboxDirs) -> None:
    d = dirs.make("n-1", mode=0o711)
    _used(d)
    dirs.remove(str(d))
    (dirs.spare / "n-1" / LOG).write_text("late line of n-1\n")
    assert (dirs.make("n-2", mode=0o711) / LOG).read_bytes() == b""


@pytest.mark.parametrize(
    "plant",
    [
        pytest.param(lambda d: (d / "left.state").write_bytes(b"z"), id="a file"),
        pytest.param(lambda d: (d / "sub").mkdir(), id="a directory"),
        pytest.param(lambda d: (d / LOG).mkdir(), id="a directory named like the log"),
        pytest.param(lambda d: (d / LOG).symlink_to("/etc/passwd"), id="a symlink as the log"),
    ],
)
def test_a_spare_holding_anything_else_is_removed_not_taken(
    dirs: SandboxDirs, plant: Callable[[Path], object]
) -> None:
    spare = dirs.spare / "old"
    spare.mkdir()
    plant(spare)
    d = dirs.make("n-1", mode=0o711)
    assert os.listdir(d) == []
    assert os.listdir(dirs.spare) == []
    assert Path("/etc/passwd").stat().st_size > 0  # not truncated through a link


def test_parking_stops_at_keep_and_the_rest_are_removed(dirs: SandboxDirs) -> None:
    made = [dirs.make(f"n-{i}", mode=0o711) for i in range(4)]
    for d in made:
        _used(d)
        dirs.remove(str(d))
    assert sorted(os.listdir(dirs.spare)) == ["n-0", "n-1"]
    assert os.listdir(dirs.root) == []


def test_a_directory_elsewhere_is_removed_not_parked(dirs: SandboxDirs, tmp_path: Path) -> None:
    bundle = tmp_path / "run" / "bundles" / "n-1"
    bundle.mkdir(parents=True)
    (bundle / "config.json").write_text("{}")
    dirs.remove(str(bundle))
    assert not bundle.exists() and os.listdir(dirs.spare) == []


def test_a_symlink_in_place_of_the_dir_is_removed_not_followed(
    dirs: SandboxDirs, tmp_path: Path
) -> None:
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("k")
    (dirs.root / "n-1").symlink_to(target)
    dirs.remove(str(dirs.root / "n-1"))
    assert (target / "keep").read_text() == "k"
    assert os.listdir(dirs.spare) == []


def test_making_an_existing_one_is_refused(dirs: SandboxDirs) -> None:
    dirs.make("n-1", mode=0o711)
    with pytest.raises(FileExistsError):
        dirs.make("n-1", mode=0o711)
