"""What a container changed in its image, read from its overlay's upper
directory on the host: the sandbox cannot hide a change from it (every
write, even one undone later, leaves its copy-up there) nor fake one.

Findings made here (api/models_report.py):
- platform_file: a binary the platform itself runs inside was replaced
  or removed (DSec's first incident: a replaced /bin/bash);
- binary_replaced: another executable or library of the image was;
- setuid: a file is setuid or setgid that was not in the image;
- package_replaced: files of an installed Python package were replaced
  or removed (an upgraded package under test); byte code caches excepted;
- protected_write: a path the task protects changed since it was
  protected (the baseline: its upper entries then); the byte code Python
  writes beside the tests it runs excepted.

An entry in the upper directory is a regular file, a symlink, or a
whiteout (a character device 0:0: the path was removed); directories only
say that something beneath them changed and are not findings themselves.
"""

from __future__ import annotations

import itertools
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# The binaries the platform runs inside a sandbox (a command string's shell,
# env for argv commands, tar for archives): under merged /usr, /bin is /usr/bin.
PLATFORM_BINARIES = frozenset(
    f"{d}/{b}"
    for d in ("bin", "usr/bin")
    for b in ("sh", "bash", "dash", "env", "tar", "cat", "sleep", "true")
)
_BINARY_DIRS = (
    "bin/",
    "sbin/",
    "usr/bin/",
    "usr/sbin/",
    "lib/",
    "lib64/",
    "usr/lib/",
    "usr/lib64/",
)
_PACKAGE_DIRS = ("/site-packages/", "/dist-packages/")
MAX_ENTRIES = 200_000  # an upper with more is read this far (the rest: one finding)

# (what, size, mtime_ns): an entry's signature for protected baselines.
Signature = tuple[str, int, int]


@dataclass(frozen=True)
class Change:
    kind: str  # a finding kind
    path: str  # "/usr/bin/bash"
    detail: str
    mtime: float  # when it changed (the entry's ctime)


@dataclass
class Walk:
    """How a walk of an upper went: cut short at MAX_ENTRIES or not."""

    truncated: bool = False


def entries(upper: Path, walk: Walk | None = None) -> Iterator[tuple[str, os.stat_result]]:
    """(relative path, lstat) of every non-directory entry of `upper`, up to
    MAX_ENTRIES entries of any kind (the sandbox makes them: a million empty
    directories must cost the host no more than the cap's worth). Cut
    short, it sets `walk.truncated`."""
    seen = 0
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            with os.scandir(upper / rel if rel else upper) as it:
                items = list(itertools.islice(it, MAX_ENTRIES + 1 - seen))
        except OSError:
            continue
        for e in items:
            seen += 1
            if seen > MAX_ENTRIES:
                if walk is not None:
                    walk.truncated = True
                return
            path = f"{rel}/{e.name}" if rel else e.name
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                stack.append(path)
                continue
            yield path, st


def _what(st: os.stat_result) -> str:
    if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
        return "removed"
    if stat.S_ISLNK(st.st_mode):
        return "symlink"
    return "file" if stat.S_ISREG(st.st_mode) else "special"


def _in_image(lower: list[Path], rel: str) -> os.stat_result | None:
    for root in lower:  # topmost first
        try:
            return os.lstat(root / rel)
        except OSError:
            continue
    return None


def under(path: str, protected: list[str]) -> bool:
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in protected)


def signatures(upper: Path, protected: list[str]) -> dict[str, Signature]:
    """The upper's entries at or under `protected` now: a baseline."""
    out: dict[str, Signature] = {}
    for rel, st in entries(upper):
        path = "/" + rel
        if under(path, protected) and not _cache(rel):
            out[path] = (_what(st), st.st_size, st.st_mtime_ns)
    return out


def changes(
    upper: Path,
    lower: list[Path],
    protected: list[str],
    baseline: dict[str, Signature],
) -> list[Change]:
    """Every change of the image and of the protected paths found in
    `upper` (see the module's docstring)."""
    out: list[Change] = []
    now_protected: dict[str, Signature] = {}
    walk = Walk()
    for rel, st in entries(upper, walk):
        path = "/" + rel
        what = _what(st)
        if protected and under(path, protected) and not _cache(rel):
            now_protected[path] = (what, st.st_size, st.st_mtime_ns)
        base = _in_image(lower, rel) if what != "special" else None
        # ctime, not mtime: a copy-up keeps the file's mtime, a chmod too;
        # both set ctime to when it happened.
        mtime = st.st_ctime
        if rel in PLATFORM_BINARIES and base is not None:
            out.append(
                Change("platform_file", path, f"{path} {what} (the platform runs it)", mtime)
            )
        elif rel.startswith(_BINARY_DIRS) and base is not None and not _cache(rel):
            if any(d in rel for d in _PACKAGE_DIRS):
                out.append(Change("package_replaced", path, f"{path} {what}", mtime))
            else:
                out.append(Change("binary_replaced", path, f"{path} {what}", mtime))
        elif any(d in rel for d in _PACKAGE_DIRS) and base is not None and not _cache(rel):
            out.append(Change("package_replaced", path, f"{path} {what}", mtime))
        suid = stat.S_ISUID | stat.S_ISGID
        if what == "file" and st.st_mode & suid and (base is None or not base.st_mode & suid):
            out.append(Change("setuid", path, f"{path} mode {st.st_mode & 0o7777:o}", mtime))
    if walk.truncated:
        # What lies past the cap was not checked: a sandbox could hide a
        # replaced binary behind enough junk. Said, never silent.
        out.append(Change("changes_unread", "/",
                          f"the writable layer holds more than {MAX_ENTRIES} entries; "
                          "those past them were not checked", time.time()))  # fmt: skip
    # Cut short, a protected path not reached is unknown, not removed.
    seen = set(now_protected) if walk.truncated else set(now_protected) | set(baseline)
    for path in sorted(seen):
        if now_protected.get(path) != baseline.get(path):
            sig = now_protected.get(path)
            what = sig[0] if sig is not None else "restored"
            when = sig[2] / 1e9 if sig is not None else 0.0
            out.append(Change("protected_write", path, f"{path} {what}", when))
    return out


def _cache(rel: str) -> bool:
    # Python writes byte code beside what it imports: honest code does that.
    return "/__pycache__/" in rel or rel.endswith((".pyc", ".pyo"))
