"""What the commands print: a rich table (or a line) for people, JSON with
--json. Every command module prints through here so the two stay alike."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

console = Console(stderr=False)


def emit(a: argparse.Namespace, doc: Any, table: Table | str | None = None) -> None:
    """`doc` as JSON with --json (or when there is nothing human to show,
    then indented), else `table`."""
    if a.json or table is None:
        print(json.dumps(doc, default=str, indent=None if a.json else 2))
    else:
        console.print(table)
