"""A Dockerfile as a list of stages of checked instructions.

The file is split into instructions by dockerfile-parse (continuations,
comments, parser directives); each instruction's arguments are read here
by Docker's rules for that instruction (exec form as JSON, `--flag=value`
options, ENV's two forms, variables). Anything Corral does not run is
refused with the line, the column and the reason, before a sandbox starts.
"""

from __future__ import annotations

import io
import json
import re
import shlex
from dataclasses import dataclass, field

from dockerfile_parse import DockerfileParser

from corral.errors import InvalidArgument

RUNS = ("RUN",)
FILES = ("COPY", "ADD")
CONFIG = ("ENV", "ARG", "WORKDIR", "USER", "LABEL", "SHELL")
RECORDED = ("CMD", "ENTRYPOINT", "EXPOSE", "VOLUME", "STOPSIGNAL", "HEALTHCHECK", "MAINTAINER")
KNOWN = ("FROM", *RUNS, *FILES, *CONFIG, *RECORDED)
_FLAGS = {"COPY": {"from", "chown", "chmod", "link"}, "ADD": {"chown", "chmod", "link"},
          "RUN": set(), "FROM": {"platform"}}  # fmt: skip
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")


@dataclass(frozen=True)
class Instruction:
    kind: str
    line: int  # 1-based, where it starts
    text: str  # as written (continuations joined)
    args: list[str]  # words, or the exec form's list
    exec_form: bool = False
    flags: dict[str, str] = field(default_factory=dict)
    raw: str = ""  # RUN's shell form: the command as written


@dataclass
class Stage:
    base: str
    name: str | None
    line: int
    steps: list[Instruction] = field(default_factory=list)


def _error(line: int, column: int, why: str, text: str) -> InvalidArgument:
    return InvalidArgument("dockerfile", f"line {line}, column {column}: {why}", text.strip()[:200])


def substitute(text: str, env: dict[str, str]) -> str:
    """$VAR, ${VAR} and ${VAR:-default} from `env` (Docker's subset)."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        return env.get(name, m.group(2) or "") if m.group(1) else env.get(name, "")

    return _VAR.sub(one, text)


def _split_flags(kind: str, value: str, line: int, content: str) -> tuple[dict[str, str], str]:
    flags: dict[str, str] = {}
    rest = value.lstrip()
    while rest.startswith("--"):
        word, _, rest = rest.partition(" ")
        name, sep, arg = word[2:].partition("=")
        if name not in _FLAGS.get(kind, set()) or not sep:
            col = content.find(word) + 1
            raise _error(line, col, f"{kind} does not take the option {word!r}", content)
        flags[name] = arg
        rest = rest.lstrip()
    return flags, rest


def _words(kind: str, value: str, line: int, content: str) -> tuple[list[str], bool]:
    """The exec form (a JSON list of strings) or shell words."""
    if value.lstrip().startswith("["):
        try:
            got = json.loads(value)
        except ValueError as exc:
            col = content.find("[") + 1 + getattr(exc, "colno", 1) - 1
            raise _error(line, col, f"the exec form is not a JSON list: {exc}", content) from None
        if not isinstance(got, list) or not all(isinstance(x, str) for x in got):
            raise _error(line, content.find("[") + 1, "the exec form must list strings", content)
        return got, True
    try:
        return shlex.split(value, posix=True), False
    except ValueError as exc:
        raise _error(line, len(content.rstrip()), f"{exc} (quotes must close)", content) from None


def parse(text: str) -> list[Stage]:
    """The Dockerfile's stages, each instruction checked."""
    parser = DockerfileParser(fileobj=io.BytesIO(text.encode()))
    stages: list[Stage] = []
    names: set[str] = set()
    for item in parser.structure:
        kind = item["instruction"].upper()
        line = int(item["startline"]) + 1
        content = item["content"]
        value = item["value"]
        if kind == "COMMENT":
            continue
        if kind not in KNOWN:
            why = f"unknown instruction {kind}"
            if kind == "ONBUILD":
                why = "ONBUILD is not supported (write the steps into the child's Dockerfile)"
            raise _error(line, 1, why, content)
        flags, rest = _split_flags(kind, value, line, content)
        if kind == "FROM":
            words = rest.split()
            if len(words) == 3 and words[1].upper() == "AS":
                base, name = words[0], words[2].lower()
            elif len(words) == 1:
                base, name = words[0], None
            else:
                raise _error(line, 6, "FROM takes IMAGE [AS NAME]", content)
            if name is not None:
                if name in names:
                    raise _error(line, content.upper().find(" AS ") + 5,
                                 f"a stage named {name!r} exists already", content)  # fmt: skip
                names.add(name)
            stages.append(Stage(base, name, line))
            continue
        if not stages:
            if kind == "ARG":  # an ARG before FROM: for the FROM lines only; not supported
                raise _error(line, 1, "ARG before FROM is not supported", content)
            raise _error(line, 1, f"{kind} before the first FROM", content)
        if not rest.strip() and kind not in ("CMD", "ENTRYPOINT"):
            raise _error(line, len(kind) + 2, f"{kind} needs arguments", content)
        args, exec_form = _words(kind, rest, line, content)
        if kind in FILES and len(args) < 2:
            raise _error(line, len(kind) + 2, f"{kind} takes SOURCE... DEST", content)
        if kind == "COPY" and "from" in flags and not flags["from"]:
            raise _error(line, 6, "--from needs a stage or an image", content)
        if kind in ("WORKDIR", "USER") and len(args) != 1:
            raise _error(line, len(kind) + 2, f"{kind} takes one argument", content)
        if kind == "SHELL" and not exec_form:
            raise _error(line, 7, 'SHELL takes the exec form: ["bash", "-c"]', content)
        stages[-1].steps.append(
            Instruction(kind, line, content.strip(), args, exec_form, flags, rest.strip())
        )
    if not stages:
        raise InvalidArgument("dockerfile", "must have a FROM instruction", text[:200])
    return stages


def env_pairs(step: Instruction, env: dict[str, str]) -> list[tuple[str, str]]:
    """ENV's and LABEL's KEY=VALUE pairs (or ENV's old `KEY VALUE` form)."""
    if step.kind == "ENV" and step.args and "=" not in step.args[0]:
        key, _, value = step.raw.partition(" ")
        return [(key, substitute(value.strip(), env))]
    out = []
    for word in step.args:
        key, sep, value = word.partition("=")
        if not sep or not key:
            raise _error(step.line, step.text.find(word) + 1,
                         f"{step.kind} takes KEY=VALUE pairs, not {word!r}", step.text)  # fmt: skip
        out.append((key, substitute(value, env)))
    return out
