"""The requires_* markers: each one registered has a probe, and a probe
names exactly what is missing (the skip reason a reader sees)."""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..framework import capabilities as cap

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@pytest.fixture(autouse=True)
def _fresh_probes() -> Iterator[None]:
    # The probes are cached for a session; these tests change what they see.
    for probe in (cap.missing_qemu, cap.missing_postgres, cap.missing_ray):
        probe.cache_clear()
    yield
    for probe in (cap.missing_qemu, cap.missing_postgres, cap.missing_ray):
        probe.cache_clear()


def test_every_registered_requirement_has_a_probe() -> None:
    ini = tomllib.loads(PYPROJECT.read_text())["tool"]["pytest"]["ini_options"]
    registered = {m.split(":")[0] for m in ini["markers"] if m.startswith("requires_")}
    assert registered == set(cap.REQUIREMENTS)


def test_probes_name_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing on PATH, no PostgreSQL packages, Ray not importable.
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "ray", None)
    assert cap.missing_qemu() == "requires qemu-system-x86_64 (apt install qemu-system-x86)"
    assert cap.missing_postgres(str(tmp_path)) == (
        "requires PostgreSQL's server binaries (apt install postgresql)"
    )
    assert cap.missing_ray() == "requires Ray (pip install 'corral[cluster]')"


def test_probes_find_what_is_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("qemu-system-x86_64", "initdb"):
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cap.missing_qemu() is None
    assert cap.missing_postgres(str(tmp_path / "none")) is None  # initdb on PATH
