"""Generate corral/sdk/sync.py, the blocking API, from the async classes.

    python -m corral.sdk.gen_sync          # rewrite sync.py
    python -m corral.sdk.gen_sync --check  # exit 1 if sync.py is stale

Each public coroutine method of an Async* class becomes a method of the same
name and signature whose body runs the coroutine on the client's portal and
wraps returned Async* objects in their blocking twins. tests/unit checks that
the committed file equals the generated one, so the two APIs cannot drift.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
import textwrap
from pathlib import Path
from typing import Any

from corral.sdk import (
    client,
    commands,
    display,
    events,
    files,
    fncall,
    keys,
    network,
    rollouts,
    sandbox,
)

CLASSES: list[tuple[type[Any], str]] = [
    (client.AsyncClient, "Client"),
    (client.AsyncSandboxes, "Sandboxes"),
    (sandbox.AsyncSandbox, "Sandbox"),
    (commands.AsyncCommands, "Commands"),
    (commands.AsyncCommandHandle, "CommandHandle"),
    (files.AsyncFiles, "Files"),
    (network.AsyncNetwork, "Network"),
    (display.AsyncDisplay, "Display"),
    (fncall.AsyncFnCall, "FnCall"),
    (keys.AsyncKeys, "Keys"),
    (rollouts.AsyncRollouts, "Rollouts"),
    (rollouts.AsyncRollout, "Rollout"),
    (rollouts.AsyncRolloutSandbox, "RolloutSandbox"),
    (rollouts.AsyncRolloutCommands, "RolloutCommands"),
    (rollouts.AsyncRolloutFiles, "RolloutFiles"),
    (events.AsyncEventStream, "EventStream"),
]
RENAME = {cls.__name__: name for cls, name in CLASSES}
TARGET = Path(__file__).with_name("sync.py")


def _sync_type(annotation: str) -> str:
    return re.sub(r"\bAsync(\w+)", lambda m: RENAME.get(m.group(0), m.group(0)), annotation)


def _wrapper(annotation: str, expr: str) -> str:
    """Code turning an async-API value into its blocking twin."""
    m = re.fullmatch(r"(?:builtins\.)?list\[(Async\w+) \| CorralError\]", annotation)
    if m and m.group(1) in RENAME:
        twin = RENAME[m.group(1)]
        return f"[{twin}(self._portal, x) if isinstance(x, {m.group(1)}) else x for x in {expr}]"
    m = re.fullmatch(r"(?:builtins\.)?list\[(Async\w+)\]", annotation)
    if m and m.group(1) in RENAME:
        return f"[{RENAME[m.group(1)]}(self._portal, x) for x in {expr}]"
    if annotation in RENAME:
        return f"{RENAME[annotation]}(self._portal, {expr})"
    return expr


def _def(name: str, params: str, ret: str) -> list[str]:
    """A def line, one parameter per line when it would pass 100 columns."""
    line = f"    def {name}({params}) -> {ret}:"
    if len(line) <= 100:
        return [line]
    parts = [p.strip() for p in _split_params(params)]
    return [f"    def {name}(", *[f"        {p}," for p in parts], f"    ) -> {ret}:"]


def _split_params(params: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in params:
        if ch in "[(":
            depth += 1
        elif ch in "])":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    return [*out, cur]


def _signature(fn: Any) -> tuple[str, str, str]:
    """(parameters with annotations, call arguments, return annotation)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    node = tree.body[0]
    assert isinstance(node, (ast.AsyncFunctionDef, ast.FunctionDef))
    args = node.args
    params, call = [], []
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for a, d in zip(positional, defaults, strict=True):
        if a.arg == "self":
            params.append("self")
            continue
        text = a.arg + (f": {_sync_type(ast.unparse(a.annotation))}" if a.annotation else "")
        if d is not None:
            text += f" = {ast.unparse(d)}"
        params.append(text)
        call.append(a.arg)
    if args.kwonlyargs:
        params.append("*")
        for a, kd in zip(args.kwonlyargs, args.kw_defaults, strict=True):
            text = a.arg + (f": {_sync_type(ast.unparse(a.annotation))}" if a.annotation else "")
            if kd is not None:
                text += f" = {ast.unparse(kd)}"
            params.append(text)
            call.append(f"{a.arg}={a.arg}")
    ret = ast.unparse(node.returns) if node.returns else "None"
    return ", ".join(params), ", ".join(call), ret


def _attributes(cls: type[Any]) -> list[tuple[str, str]]:
    """Public attributes set in __init__ whose type is an Async* class or a
    parameter annotation: (name, async type)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    fn = tree.body[0]
    assert isinstance(fn, ast.FunctionDef)
    annotations = {a.arg: ast.unparse(a.annotation) for a in fn.args.args if a.annotation}
    out = []
    for stmt in ast.walk(fn):
        if not isinstance(stmt, ast.Assign) or len(stmt.targets) != 1:
            continue
        target = stmt.targets[0]
        if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)):
            continue
        if target.value.id != "self" or target.attr.startswith("_"):
            continue
        value = stmt.value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
            out.append((target.attr, value.func.id))
        elif isinstance(value, ast.Name) and value.id in annotations:
            out.append((target.attr, annotations[value.id]))
    return out


def _docstring(fn: Any) -> list[str]:
    """The first paragraph of fn's docstring, rewrapped for the twin."""
    doc = inspect.getdoc(fn)
    if not doc:
        return []
    wrapped = textwrap.wrap(" ".join(doc.split("\n\n")[0].split()), 88)
    wrapped[0] = '"""' + wrapped[0]
    wrapped[-1] += '"""'
    return ["        " + w for w in wrapped]


def _class(cls: type[Any], name: str) -> str:
    lines = [f"class {name}:"]
    doc = inspect.getdoc(cls)
    summary = f" {doc.splitlines()[0]}" if doc else ""
    lines.append(f'    """Blocking twin of {cls.__name__}.{summary}"""')
    lines.append("")
    if cls is client.AsyncClient:
        params, call, _ = _signature(cls.__init__)
        lines += _def("__init__", params, "None")
        lines += [
            "        self._portal = Portal()",
            "        self._inner = AsyncClient(",
            *[f"            {c}," for c in call.split(", ")],
            "        )",
            "        self.sandboxes = Sandboxes(self._portal, self._inner.sandboxes)",
            "        self.fncall = FnCall(self._portal, self._inner.fncall)",
            "        self.rollouts = Rollouts(self._portal, self._inner.rollouts)",
            "        self.keys = Keys(self._portal, self._inner.keys)",
            "",
            "    def __enter__(self) -> Client:",
            "        self.open()",
            "        return self",
            "",
            "    def __exit__(self, *exc: object) -> None:",
            "        self.close()",
            "",
            "    def open(self) -> Client:",
            "        self._portal.call(self._inner.open)",
            "        return self",
            "",
            "    def close(self) -> None:",
            "        try:",
            "            self._portal.call(self._inner.aclose)",
            "        finally:",
            "            self._portal.close()",
            "",
        ]
        skip = {"open", "aclose"}
    else:
        lines += [
            f"    def __init__(self, portal: Portal, inner: {cls.__name__}) -> None:",
            "        self._portal = portal",
            "        self._inner = inner",
        ]
        for attr, typ in _attributes(cls):
            if typ in RENAME:
                lines.append(f"        self.{attr} = {RENAME[typ]}(portal, inner.{attr})")
        lines.append("")
        skip = set()
        for attr, typ in _attributes(cls):
            if typ not in RENAME:
                lines += [
                    "    @property",
                    f"    def {attr}(self) -> {typ}:",
                    f"        return self._inner.{attr}",
                    "",
                ]
    for attr_name, member in inspect.getmembers(cls):
        if attr_name.startswith("_") or attr_name in skip:
            continue
        if isinstance(member, property):
            ret = inspect.signature(member.fget).return_annotation  # type: ignore[arg-type]
            lines += [
                "    @property",
                f"    def {attr_name}(self) -> {_sync_type(str(ret))}:",
                f"        return {_wrapper(str(ret), f'self._inner.{attr_name}')}",
                "",
            ]
        elif inspect.iscoroutinefunction(member):
            params, call, ret = _signature(member)
            lines += _def(attr_name, params, _sync_type(ret))
            lines += _docstring(member)
            result = f"self._portal.call(self._inner.{attr_name}{', ' if call else ''}{call})"
            line = f"        return {_wrapper(ret, result)}"
            if len(line) > 100:
                line = f"        result = {result}\n        return {_wrapper(ret, 'result')}"
                if len(line.splitlines()[0]) > 100:
                    args = ",\n            ".join(["self._inner." + attr_name, *call.split(", ")])
                    line = (
                        f"        result = self._portal.call(\n            {args},\n        )\n"
                        f"        return {_wrapper(ret, 'result')}"
                    )
            lines.append(line)
            lines.append("")
        elif inspect.isfunction(member):  # a plain method: called as it is
            params, call, ret = _signature(member)
            lines += _def(attr_name, params, _sync_type(ret))
            lines += _docstring(member)
            lines.append(f"        return self._inner.{attr_name}({call})")
            lines.append("")
    if name == "Sandbox":
        lines += [
            "    def __enter__(self) -> Sandbox:",
            "        return self",
            "",
            "    def __exit__(self, *exc: object) -> None:",
            "        self.close()",
            "",
            "    def __repr__(self) -> str:",
            "        return repr(self._inner).replace('AsyncSandbox', 'Sandbox')",
            "",
        ]
    return "\n".join(lines).rstrip() + "\n"


def generate() -> str:
    head = '''"""The blocking API. GENERATED by corral/sdk/gen_sync.py from the async
classes: do not edit; run `python -m corral.sdk.gen_sync` after changing them.

Callbacks (on_stdout, on_stderr) run on the client's private event loop
thread; they must not call back into the blocking client.
"""

from __future__ import annotations

import builtins
import signal as signals
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from corral.api.models import (
    ApiKey,
    App,
    AuditReport,
    DisplayState,
    Event,
    FileEntry,
    FnCallRequest,
    FnCallResult,
    LayerInfo,
    NetworkPolicy,
    RolloutReport,
    SandboxInfo,
    SavedState,
    Usage,
    ViewAccess,
    Window,
)
from corral.api.service import SandboxService
from corral.api.verdict import Rules
from corral.config import NodeConfig
from corral.errors import CorralError
from corral.sdk.client import AsyncClient, AsyncSandboxes, BulkOutcome
from corral.sdk.commands import (
    AsyncCommandHandle,
    AsyncCommands,
    CommandResult,
    MiB,
    OutputCallback,
)
from corral.sdk.display import AsyncDisplay
from corral.sdk.events import AsyncEventStream
from corral.sdk.files import AsyncFiles
from corral.sdk.fncall import AsyncFnCall
from corral.sdk.keys import AsyncKeys
from corral.sdk.network import AsyncNetwork
from corral.sdk.portal import Portal
from corral.sdk.rollouts import (
    AsyncRollout,
    AsyncRolloutCommands,
    AsyncRolloutFiles,
    AsyncRollouts,
    AsyncRolloutSandbox,
)
from corral.sdk.sandbox import AsyncSandbox

__all__ = [
    "Client",
    "CommandHandle",
    "Commands",
    "Display",
    "EventStream",
    "Files",
    "FnCall",
    "Keys",
    "Network",
    "Rollout",
    "RolloutCommands",
    "RolloutFiles",
    "RolloutSandbox",
    "Rollouts",
    "Sandbox",
    "Sandboxes",
]
'''
    order = [
        "Files",
        "Network",
        "Display",
        "CommandHandle",
        "Commands",
        "Sandbox",
        "Sandboxes",
        "FnCall",
        "Keys",
        "RolloutCommands",
        "RolloutFiles",
        "RolloutSandbox",
        "Rollout",
        "Rollouts",
        "EventStream",
        "Client",
    ]
    by_name = {name: cls for cls, name in CLASSES}
    body = "\n\n".join(_class(by_name[n], n) for n in order)
    return head + "\n\n" + body


def main() -> int:
    text = generate()
    if "--check" in sys.argv:
        if TARGET.read_text() != text:
            print(f"{TARGET} is stale: run python -m corral.sdk.gen_sync", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
