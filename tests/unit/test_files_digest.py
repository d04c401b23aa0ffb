"""files_digest: the part of a cached layer's key its source folder makes.
A layer is rebuilt exactly when a file's bytes or its path change."""

from __future__ import annotations

from pathlib import Path

from corral.images.build import files_digest


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def test_the_digest_follows_bytes_and_paths_not_times(tmp_path: Path) -> None:
    base = {"build.sh": b"echo hi\n", "sub/Kernel.java": b"class K {}\n"}
    a = files_digest(_tree(tmp_path / "a", base))
    b = _tree(tmp_path / "b", base)
    (b / "build.sh").touch()  # a new mtime alone changes nothing
    assert files_digest(b) == a
    changed = files_digest(_tree(tmp_path / "c", {**base, "build.sh": b"echo ho\n"}))
    moved = files_digest(
        _tree(tmp_path / "d", {"build.sh": b"echo hi\n", "Kernel.java": b"class K {}\n"})
    )
    added = files_digest(_tree(tmp_path / "e", {**base, "extra": b""}))
    assert len({a, changed, moved, added}) == 4


def test_an_empty_folder_has_a_digest(tmp_path: Path) -> None:
    assert files_digest(tmp_path) == files_digest(tmp_path)
    assert len(files_digest(tmp_path)) == 16
