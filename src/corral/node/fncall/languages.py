"""The language table of function calls: data, read from languages.toml
(shipped) and the node's own file over it."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from corral.errors import InvalidArgument

SHIPPED = Path(__file__).with_name("languages.toml")


@dataclass(frozen=True)
class Language:
    name: str
    source: str
    run: tuple[str, ...]
    compile: tuple[str, ...] | None = None


def _entry(name: str, raw: object, origin: Path) -> Language:
    def bad(rule: str) -> InvalidArgument:
        return InvalidArgument(f"{origin}:[{name}]", rule, raw)

    if not isinstance(raw, dict):
        raise bad("must be a table")
    source, run, comp = raw.get("source"), raw.get("run"), raw.get("compile")
    if not isinstance(source, str) or not source or "/" in source:
        raise bad("source must be a plain file name")

    def argv_ok(argv: object) -> bool:
        return isinstance(argv, list) and bool(argv) and all(isinstance(a, str) for a in argv)

    if not argv_ok(run) or (comp is not None and not argv_ok(comp)):
        raise bad("run (and compile, if given) must be non-empty lists of strings")
    assert isinstance(run, list)
    return Language(name, source, tuple(run), tuple(comp) if isinstance(comp, list) else None)


def load(*files: Path) -> dict[str, Language]:
    """Name and alias -> language; later files override earlier ones."""
    table: dict[str, Language] = {}
    for path in files:
        if not path.exists():
            continue
        with open(path, "rb") as f:
            data = tomllib.load(f)
        for name, raw in data.items():
            lang = _entry(name, raw, path)
            table[name] = lang
            aliases = raw.get("aliases", []) if isinstance(raw, dict) else []
            for alias in aliases:
                table[str(alias)] = lang
    return table
