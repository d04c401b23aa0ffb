"""What an agent may do in an episode's sandbox, parsed from what a model
wrote: a tool call's arguments (a JSON object, or the string the model
meant as one) or free text with tags.

Parsing never raises for the model's mistakes: a bad action becomes an
ActionError whose message is written for the model to read and act on,
since in RL a malformed tool call is the common case, not an exception.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# A path an action names: relative to the episode's workdir, or absolute.
_MAX_PATH = 4096


@dataclass(frozen=True)
class Shell:
    command: str
    timeout: float | None = None


@dataclass(frozen=True)
class Write:
    path: str
    content: str


@dataclass(frozen=True)
class Edit:
    """Replace the one occurrence of `old` in a file by `new`."""

    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Read:
    path: str


@dataclass(frozen=True)
class Submit:
    """End the episode: the reward is computed now."""


Action = Shell | Write | Edit | Read | Submit


@dataclass(frozen=True)
class ActionError:
    """An action the model got wrong; `message` is its observation."""

    message: str


USAGE_JSON = (
    'one of {"command": "..."} (a shell command), {"path": "...", "content": "..."} '
    '(write a file), {"path": "...", "old": "...", "new": "..."} (replace text in a file), '
    '{"path": "..."} (read a file) or {"submit": true} (finish and be graded)'
)
USAGE_TEXT = (
    '<bash>COMMAND</bash>, <write path="PATH">CONTENT</write>, '
    '<edit path="PATH"><old>TEXT</old><new>TEXT</new></edit>, <read path="PATH"/> '
    "or <submit/>"
)


def _str(args: dict[str, Any], key: str) -> str | ActionError:
    value = args[key]
    if not isinstance(value, str):
        return ActionError(f"error: `{key}` must be a string, got {type(value).__name__}")
    return value


def _path(args: dict[str, Any]) -> str | ActionError:
    path = _str(args, "path")
    if isinstance(path, ActionError):
        return path
    if not path or len(path) > _MAX_PATH or "\0" in path:
        return ActionError(f"error: `path` must be 1-{_MAX_PATH} characters with no NUL byte")
    return path


def from_arguments(args: Any) -> Action | ActionError:
    """A tool call's arguments: a dict, or the JSON text of one (what the
    model wrote when the framework did not decode it)."""
    if isinstance(args, (str, bytes)):
        try:
            args = json.loads(args)
        except ValueError as exc:
            return ActionError(
                f"error: the arguments must be a JSON object, got text that is not JSON "
                f"({exc}); send {USAGE_JSON}"
            )
    if not isinstance(args, dict):
        return ActionError(
            f"error: the arguments must be a JSON object, got {type(args).__name__}; "
            f"send {USAGE_JSON}"
        )
    keys = set(args)
    if "submit" in keys:
        if keys != {"submit"} or args["submit"] is not True:
            return ActionError('error: to finish, send exactly {"submit": true}')
        return Submit()
    if "command" in keys:
        unknown = keys - {"command", "timeout"}
        if unknown:
            return ActionError(f"error: unknown field `{sorted(unknown)[0]}` beside `command`")
        command = _str(args, "command")
        if isinstance(command, ActionError):
            return command
        if not command.strip():
            return ActionError("error: `command` is empty")
        timeout = args.get("timeout")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
        ):
            return ActionError(f"error: `timeout` must be a positive number: {timeout!r}")
        return Shell(command, float(timeout) if timeout is not None else None)
    if "path" in keys:
        path = _path(args)
        if isinstance(path, ActionError):
            return path
        if keys == {"path"}:
            return Read(path)
        if keys == {"path", "content"}:
            content = _str(args, "content")
            return content if isinstance(content, ActionError) else Write(path, content)
        if keys == {"path", "old", "new"}:
            old, new = _str(args, "old"), _str(args, "new")
            if isinstance(old, ActionError):
                return old
            if isinstance(new, ActionError):
                return new
            if not old:
                return ActionError("error: `old` is empty: give the exact text to replace")
            return Edit(path, old, new)
    return ActionError(f"error: unrecognised fields {sorted(keys)}; send {USAGE_JSON}")


_TAG = re.compile(
    r"<bash>(?P<bash>.*?)</bash>"
    r"|<write\s+path=\"(?P<wpath>[^\"]*)\"\s*>(?P<content>.*?)</write>"
    r"|<edit\s+path=\"(?P<epath>[^\"]*)\"\s*>\s*<old>(?P<old>.*?)</old>\s*"
    r"<new>(?P<new>.*?)</new>\s*</edit>"
    r"|<read\s+path=\"(?P<rpath>[^\"]*)\"\s*/>"
    r"|(?P<submit><submit\s*/>)",
    re.DOTALL,
)


def from_text(text: str) -> Action | ActionError:
    """The first tagged action in a model's free text (the rest of the text,
    its reasoning, is ignored)."""
    m = _TAG.search(text)
    if m is None:
        return ActionError(f"error: no action found; write exactly one of {USAGE_TEXT}")
    if m["submit"] is not None:
        return Submit()
    if m["bash"] is not None:
        return from_arguments({"command": m["bash"].strip()})
    if m["wpath"] is not None:
        return from_arguments({"path": m["wpath"], "content": m["content"]})
    if m["epath"] is not None:
        return from_arguments({"path": m["epath"], "old": m["old"], "new": m["new"]})
    return from_arguments({"path": m["rpath"]})
