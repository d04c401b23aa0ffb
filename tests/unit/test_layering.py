"""The import graph of src/corral, read statically (ast, nothing imported):
no circle between modules, and no part imports a part above it.

Parts are corral's top-level subpackages and modules, lowest first (see
RANKS). A module may import its own part and lower parts only; `images`
and `guard` share a rank and may not import each other; the base modules
form one part and may import each other. Every import counts: at module
level, inside functions, under TYPE_CHECKING, relative ones. The package
root (corral/__init__.py) is the public facade: exempt as an importer, but
nothing inside corral may import from it (`import corral`, `from corral
import __version__`); submodules named through it (`from corral import
metrics`) are imports of those submodules.

The checker is tested on fake graphs and a fake package first, so that a
checker that finds nothing cannot pass for a clean tree.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
ROOT = "corral"
BASE = (
    "errors",
    "units",
    "log",
    "trace",
    "metrics",
    "ids",
    "labels",
    "addresses",
    "capacity",
    "config",
    "progress",
    "version",
    "db",
)
# Lowest first; parts on one line share a rank (and so may not import each other).
RANKS: tuple[tuple[str, ...], ...] = (
    ("base",),
    ("execd",),
    ("host",),
    ("images", "guard"),
    ("runtimes",),
    ("api",),
    ("node",),
    ("control",),
    ("dashboard",),
    ("sdk",),
    ("build",),
    ("tasks",),
    ("server",),
    ("cluster",),
    ("integrations",),
    ("rollout",),
    ("cli",),
)
RANK = {part: i for i, parts in enumerate(RANKS) for part in parts}


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name
    imported: str  # dotted module name (a package's means its __init__)
    line: int
    names: tuple[str, ...] = ()  # for `from X import a, b`: the names taken from X

    def where(self) -> str:
        return f"{self.importer}:{self.line}"


# ---------------------------------------------------------------- reading the tree


def modules(src: Path, package: str = ROOT) -> dict[str, Path]:
    """Dotted name -> file of every module of `package` under src."""
    found: dict[str, Path] = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _known(name: str, known: Mapping[str, Path]) -> str:
    """The longest known module `name` lies in (an import of a missing
    module still counts against the part it names)."""
    while name not in known and "." in name:
        name = name.rpartition(".")[0]
    return name


def imports_of(
    name: str, path: Path, known: Mapping[str, Path], package: str = ROOT
) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: list[Import] = []
    for node in ast.walk(tree):  # every import: module level, functions, TYPE_CHECKING
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _within(alias.name, package):
                    found.append(Import(name, _known(alias.name, known), node.lineno))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if not _within(target, package):
                continue
            # `from X import y`: the submodule X.y if there is one, else a name of X.
            of_target: list[str] = []
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    found.append(Import(name, sub, node.lineno))
                else:
                    of_target.append(alias.name)
            if of_target:
                found.append(Import(name, _known(target, known), node.lineno, tuple(of_target)))
    return found


def graph(src: Path, package: str = ROOT) -> list[Import]:
    known = modules(src, package)
    return [i for name, path in known.items() for i in imports_of(name, path, known, package)]


# ---------------------------------------------------------------- the rules


def part_of(module: str, package: str = ROOT) -> str:
    """The part a module belongs to; "" for the package root."""
    if module == package:
        return ""
    top = module.split(".")[1]
    return "base" if top in BASE else top


def unranked(mods: Iterable[str], package: str = ROOT) -> list[str]:
    """Parts that RANKS does not place: a new part must be given a rank."""
    return sorted({p for m in mods if (p := part_of(m, package)) and p not in RANK})


def layer_violations(edges: Iterable[Import], package: str = ROOT) -> list[str]:
    out: set[tuple[str, int, str]] = set()
    for e in edges:
        src, dst = part_of(e.importer, package), part_of(e.imported, package)
        if src == "" or src == dst:
            continue  # the root is the public facade: it may import anything
        if dst == "":
            names = ", ".join(e.names) if e.names else "the package"
            why = f"{names} from the package root {package} (import the module that defines it)"
        elif src not in RANK or dst not in RANK:
            why = f"{e.imported}: {src} -> {dst} involves a part no rank places"
        elif RANK[dst] == RANK[src]:
            why = f"{e.imported}: {src} -> {dst} is a part of the same rank"
        elif RANK[dst] > RANK[src]:
            why = f"{e.imported}: {src} -> {dst} is a higher part"
        else:
            continue
        out.add((e.importer, e.line, f"{e.where()} imports {why}"))
    return [line for *_, line in sorted(out)]


def _components(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(graph.get(start, ())))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            v, todo = work[-1]
            if todo:
                w = todo.pop(0)
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, sorted(graph.get(w, ()))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp: list[str] = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def _shortest_circle(graph: Mapping[str, set[str]], members: list[str]) -> list[str]:
    """A shortest circle through the first member, inside its component."""
    inside, start = set(members), members[0]
    came: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph.get(v, ())):
            if w not in inside:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came[path[-1]])
                return [*reversed(path), start]
            if w not in came:
                came[w] = v
                queue.append(w)
    raise AssertionError(f"no circle through {start} in {members}")


def circles(edges: Iterable[Import], package: str = ROOT) -> list[str]:
    """One line per import circle: a shortest circle, and every module of
    its tangle when there are more."""
    g: dict[str, set[str]] = {}
    for e in edges:
        if e.importer != package and e.importer != e.imported:  # the root is exempt
            g.setdefault(e.importer, set()).add(e.imported)
    out = []
    for comp in _components(g):
        if len(comp) > 1:
            line = " -> ".join(_shortest_circle(g, comp))
            if len(comp) > len(line.split(" -> ")) - 1:
                line += f" (tangle of {len(comp)}: {', '.join(comp)})"
            out.append(line)
    return sorted(out)


# ---------------------------------------------------------------- the checker, checked


def _edges(*pairs: str) -> list[Import]:
    """'a>b' pairs of short module names under corral."""
    out = []
    for n, pair in enumerate(pairs):
        a, b = pair.split(">")
        out.append(Import(f"{ROOT}.{a}" if a else ROOT, f"{ROOT}.{b}" if b else ROOT, n + 1))
    return out


@pytest.mark.parametrize(
    ("edges", "violations", "found_circles"),
    [
        # Allowed: downward, within a part, between base modules, the root outward.
        (_edges("node.a>host.b", "node.a>node.b", "errors>log", ">cli.main"), 0, 0),
        # Upward, and sideways within one rank.
        (_edges("host.cgroups>node.store"), 1, 0),
        (_edges("images.store>guard.net"), 1, 0),
        (_edges("guard.net>images.store"), 1, 0),
        (_edges("errors>execd.protocol"), 1, 0),
        # The package root, and a part no rank places.
        (_edges("node.a>"), 1, 0),
        (_edges("node.a>teleport.x"), 1, 0),
        # Circles: two modules, three, and one across parts (also upward).
        (_edges("sdk.a>sdk.b", "sdk.b>sdk.a"), 0, 1),
        (_edges("sdk.a>sdk.b", "sdk.b>sdk.c", "sdk.c>sdk.a", "sdk.c>sdk.d"), 0, 1),
        (_edges("api.a>node.b", "node.b>api.a"), 1, 1),
        # A circle through the root is not one: the root is exempt as an importer.
        (_edges(">sdk.a", "sdk.a>"), 1, 0),
    ],
)
def test_the_checker_finds_what_it_should(
    edges: list[Import], violations: int, found_circles: int
) -> None:
    assert len(layer_violations(edges)) == violations, layer_violations(edges)
    assert len(circles(edges)) == found_circles, circles(edges)


def test_a_circle_is_named_by_its_modules() -> None:
    (line,) = circles(_edges("sdk.a>sdk.b", "sdk.b>sdk.c", "sdk.c>sdk.a", "sdk.b>sdk.a"))
    assert line == "corral.sdk.a -> corral.sdk.b -> corral.sdk.a (tangle of 3: " + (
        "corral.sdk.a, corral.sdk.b, corral.sdk.c)"
    )


def test_the_reader_sees_every_kind_of_import(tmp_path: Path) -> None:
    pkg = tmp_path / ROOT
    for d in ("node", "host", "sdk"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("__version__ = '1'\nfrom corral.sdk.client import C\n")
    (pkg / "errors.py").write_text("")
    (pkg / "host" / "mounts.py").write_text("")
    (pkg / "sdk" / "client.py").write_text("")
    (pkg / "node" / "store.py").write_text("")
    (pkg / "node" / "agent.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "import os\n"
        "import corral.errors\n"
        "from . import store\n"
        "from ..host import mounts\n"
        "from corral import errors, __version__\n"
        "if TYPE_CHECKING:\n"
        "    from corral.sdk.client import C\n"
        "def f() -> None:\n"
        "    from .store import Store\n"
        "    import corral\n"
    )
    edges = [(e.imported, e.line, e.names) for e in graph(tmp_path) if e.importer.endswith("agent")]
    assert edges == [
        ("corral.errors", 3, ()),
        ("corral.node.store", 4, ()),
        ("corral.host.mounts", 5, ()),
        ("corral.errors", 6, ()),
        ("corral", 6, ("__version__",)),
        ("corral.sdk.client", 8, ("C",)),
        ("corral.node.store", 10, ("Store",)),
        ("corral", 11, ()),
    ]
    assert layer_violations(graph(tmp_path)) == [
        "corral.node.agent:6 imports __version__ from the package root corral "
        "(import the module that defines it)",
        "corral.node.agent:8 imports corral.sdk.client: node -> sdk is a higher part",
        "corral.node.agent:11 imports the package from the package root corral "
        "(import the module that defines it)",
    ]


# ---------------------------------------------------------------- the real tree


@pytest.fixture(scope="module")
def real() -> list[Import]:
    edges = graph(SRC)
    # A reader that found nothing would pass every rule: make sure it read.
    assert len(modules(SRC)) > 100 and len(edges) > 500, (len(modules(SRC)), len(edges))
    assert Import("corral.node.agent", "corral.node.store", 0) in {
        Import(e.importer, e.imported, 0) for e in edges
    }
    return edges


def test_every_part_has_a_rank() -> None:
    assert unranked(modules(SRC)) == []


def test_no_import_circles(real: list[Import]) -> None:
    found = circles(real)
    assert not found, "import circles:\n  " + "\n  ".join(found)


def test_no_part_imports_a_higher_one(real: list[Import]) -> None:
    found = layer_violations(real)
    assert not found, "imports against the layering:\n  " + "\n  ".join(found)
