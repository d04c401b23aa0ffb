"""A build's context: the directory COPY and ADD read from, less what
.dockerignore excludes.

.dockerignore follows Docker's rules: one pattern a line, `#` comments,
`*` and `?` within a path part, `**` across parts, `!` re-including, the
last matching line deciding; a pattern that matches a directory excludes
what is under it. A source must stay inside the context: `..`, an
absolute path or a symlink that leads out is refused.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from corral.errors import InvalidArgument


def _regex(pattern: str) -> re.Pattern[str]:
    """Docker's path match: `*`, `?` and `[...]` within a part, `**` across
    parts; a match also covers what is under it."""
    out = ""
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif c == "*":
            out += "[^/]*"
            i += 1
        elif c == "?":
            out += "[^/]"
            i += 1
        elif c == "[" and "]" in pattern[i + 1 :]:
            j = pattern.index("]", i + 1)
            body = pattern[i + 1 : j]
            out += "[" + ("^" + body[1:] if body.startswith("!") else body) + "]"
            i = j + 1
        else:
            out += re.escape(c)
            i += 1
    return re.compile(f"^{out}(?:/.*)?$")


@dataclass
class Context:
    root: Path
    rules: list[tuple[bool, re.Pattern[str]]]  # (exclude?, pattern)

    @classmethod
    def open(cls, root: Path) -> Context:
        if not root.is_dir():
            raise InvalidArgument("context", "must be a directory", str(root))
        rules = []
        ignore = root / ".dockerignore"
        if ignore.is_file():
            for raw in ignore.read_text().splitlines():
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                include = line.startswith("!")
                pat = os.path.normpath(line.lstrip("!").strip().lstrip("/"))
                rules.append((not include, _regex(pat)))
        return cls(root.resolve(), rules)

    def ignored(self, rel: str) -> bool:
        verdict = False
        for exclude, pattern in self.rules:
            if pattern.match(rel):
                verdict = exclude
        return verdict

    def _inside(self, src: str, line: int) -> Path:
        rel = os.path.normpath(src.lstrip("/")) if src not in ("", ".", "/") else "."
        path = (self.root / rel).resolve()
        if rel.startswith("..") or not path.is_relative_to(self.root):
            raise InvalidArgument(
                "dockerfile", f"line {line}: COPY source must be inside the context", src
            )
        return path

    def files(self, sources: list[str], line: int) -> list[tuple[Path, str]]:
        """(path, name in the copy) for each source, globs expanded:
        a directory's contents go under the destination, a file by its name."""
        out: list[tuple[Path, str]] = []
        for src in sources:
            matches = sorted(self.root.glob(src.lstrip("/"))) if any(
                c in src for c in "*?[") else [self._inside(src, line)]  # fmt: skip
            if not matches or not all(m.exists() for m in matches):
                raise InvalidArgument(
                    "dockerfile", f"line {line}: COPY source is not in the context", src
                )
            for m in matches:
                m = self._inside(str(m.relative_to(self.root)) if m.is_absolute() else str(m),
                                 line)  # fmt: skip
                if m.is_dir():
                    for p in sorted(m.rglob("*")):
                        rel = str(p.relative_to(self.root))
                        if not self.ignored(rel):
                            out.append((p, str(p.relative_to(m))))
                elif not self.ignored(str(m.relative_to(self.root))):
                    out.append((m, m.name))
        return out

    def tar(self, files: list[tuple[Path, str]], mode: int | None = None,
            owner: tuple[int, int] | None = None) -> tuple[bytes, str]:  # fmt: skip
        """The files as a tar (names relative to the destination) and a
        digest of their names, modes and contents: the step's cache key."""
        buf = io.BytesIO()
        h = hashlib.sha256()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for path, name in files:
                info = tar.gettarinfo(str(path), name)
                info.mtime = 0
                info.uname = info.gname = ""
                if mode is not None and not info.isdir():
                    info.mode = mode
                if owner is not None:
                    info.uid, info.gid = owner
                else:
                    info.uid = info.gid = 0
                h.update(f"{name}\0{info.type!r}\0{info.mode}\0{info.uid}\0{info.linkname}\0"
                         .encode())  # fmt: skip
                if info.isreg():
                    data = path.read_bytes()
                    h.update(hashlib.sha256(data).digest())
                    tar.addfile(info, io.BytesIO(data))
                else:
                    tar.addfile(info)
        return buf.getvalue(), h.hexdigest()
