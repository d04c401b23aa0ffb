"""Markers by folder: tests/unit are `unit` (no root, no kernel features),
tests/integration are `integration` (root and a real kernel), tests/redteam
are `redteam`. See docs/testing.md."""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).parts
        for folder in ("unit", "integration", "redteam"):
            if folder in parts:
                item.add_marker(getattr(pytest.mark, folder))
