"""The language table of function calls: data, read from languages.toml
(shipped) and the node's own file over it."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from corral.api.models_base import REF, REF_RULE
from corral.errors import InvalidArgument

SHIPPED = Path(__file__).with_name("languages.toml")


@dataclass(frozen=True)
class Language:
    name: str
    source: str
    run: tuple[str, ...]
    compile: tuple[str, ...] | None = None
    env: tuple[str, ...] = ()  # NAME=value, over the call's own environment
    # Run in a worker after each reset, before a call takes it (a warm
    # Jupyter kernel): such a language has workers of its own.
    prepare: tuple[str, ...] | None = None
    # The workers' image, IMAGE[+TOOLKIT,...], when not the node's default
    # (NodeConfig.fncall_worker): a toolchain kept in an image of its own.
    image: str | None = None
    # Why this node cannot run it (no toolchain to be had): a call in it is
    # refused with this, naming the language, instead of failing inside.
    unavailable: str | None = None


def _image_ok(image: object) -> bool:
    if not isinstance(image, str):
        return False
    base, plus, toolkit = image.partition("+")
    refs = [base, *toolkit.split(",")] if plus else [base]
    return all(REF.match(r) for r in refs)


def _entry(name: str, raw: object, origin: Path) -> Language:
    def bad(rule: str) -> InvalidArgument:
        return InvalidArgument(f"{origin}:[{name}]", rule, raw)

    if not isinstance(raw, dict):
        raise bad("must be a table")
    unknown = sorted(
        set(raw) - {"source", "run", "compile", "prepare", "env", "image", "aliases", "unavailable"}
    )
    if unknown:
        raise bad(f"has no field {unknown[0]!r}")
    why = raw.get("unavailable")
    if why is not None:
        if not isinstance(why, str) or not why:
            raise bad("unavailable must be a non-empty string saying why")
        return Language(name, "", (), unavailable=why)
    source, run, comp = raw.get("source"), raw.get("run"), raw.get("compile")
    prep = raw.get("prepare")
    if not isinstance(source, str) or not source or "/" in source:
        raise bad("source must be a plain file name")

    def argv_ok(argv: object) -> bool:
        return isinstance(argv, list) and bool(argv) and all(isinstance(a, str) for a in argv)

    if not argv_ok(run) or any(x is not None and not argv_ok(x) for x in (comp, prep)):
        raise bad("run (and compile and prepare, if given) must be non-empty lists of strings")
    env = raw.get("env", [])
    if not isinstance(env, list) or not all(isinstance(e, str) and "=" in e for e in env):
        raise bad("env must be a list of NAME=value strings")
    assert isinstance(run, list)
    compile_ = tuple(comp) if isinstance(comp, list) else None
    prepare = tuple(prep) if isinstance(prep, list) else None
    image = raw.get("image")
    if image is not None and not _image_ok(image):
        raise bad(f"image must be IMAGE[+TOOLKIT,...], each an image reference ({REF_RULE})")
    return Language(name, source, tuple(run), compile_, tuple(env), prepare, image)


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
