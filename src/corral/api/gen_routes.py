"""Generate the three surfaces of the route table (api/routes.py):

    api/endpoints.py        the FastAPI endpoints (create_app adds them)
    api/http.py             HttpService, the client
    control/forwarding.py   the operations a gateway forwards to a node

    python -m corral.api.gen_routes          # rewrite them
    python -m corral.api.gen_routes --check  # exit 1 if one is stale

Each generated method has the signature SandboxService declares (read from
api/service.py's source, so annotations and defaults keep their spelling)
and a body that moves its arguments as the route says. Generated code is
plain Python that mypy checks against the service like hand-written code,
and that `ruff format` leaves as it is. tests/unit/test_routes.py fails if
a committed file differs from what this writes.
"""

from __future__ import annotations

import ast
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from corral.api import models, routes, service
from corral.api.routes import (
    Body,
    Bytes,
    Events,
    Json,
    Labels,
    NoContent,
    Query,
    Raw,
    Route,
    Sse,
)

API = Path(__file__).parent
TARGETS = {
    "endpoints": API / "endpoints.py",
    "http": API / "http.py",
    "forwarding": API.parent / "control" / "forwarding.py",
}
WIDTH = 100
_LIST = re.compile(r"(?:builtins\.)?list\[(\w+)\]")
# Names the generated bodies use for their own locals and parameters.
_TAKEN = ("self", "svc", "request", "resp", "node")


def _is_model(annotation: str) -> bool:
    """A wire model corral.api.models exports (what a body or a reply may be)."""
    found = getattr(models, annotation, None) if annotation in models.__all__ else None
    return isinstance(found, type) and issubclass(found, BaseModel)


def _model_list(annotation: str) -> str | None:
    """The model of a list-of-models annotation, else None."""
    m = _LIST.fullmatch(annotation)
    return m.group(1) if m and _is_model(m.group(1)) else None


@dataclass(frozen=True)
class Param:
    name: str
    annotation: str
    default: str | None

    def declared(self) -> str:
        return self.name + f": {self.annotation}" + (f" = {self.default}" if self.default else "")


@dataclass(frozen=True)
class Op:
    name: str
    params: tuple[Param, ...]
    returns: str
    is_async: bool

    def param(self, name: str) -> Param:
        return next(p for p in self.params if p.name == name)


def operations() -> dict[str, Op]:
    """SandboxService's methods, as its source spells them."""
    source = inspect.getsource(service)
    tree = ast.parse(source)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SandboxService")
    out = {}
    for fn in cls.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = fn.args.args[1:]  # self
        defaults = [None] * (len(args) - len(fn.args.defaults)) + list(fn.args.defaults)
        params = tuple(
            Param(a.arg, _text(source, a.annotation), _text(source, d) if d else None)
            for a, d in zip(args, defaults, strict=True)
        )
        out[fn.name] = Op(
            fn.name, params, _text(source, fn.returns), isinstance(fn, ast.AsyncFunctionDef)
        )
    return out


def _text(source: str, node: ast.expr | None) -> str:
    text = ast.get_source_segment(source, node) if node is not None else None
    if text is None:
        raise ValueError("every SandboxService parameter and result must be annotated")
    return text


# ------------------------------------------------------------ the table, checked


def check(table: tuple[Route, ...], ops: dict[str, Op]) -> None:
    """The table and the service agree: every operation has one route or is
    local-only, and every route places each of its operation's arguments
    once, in a way its type can travel. ValueError says what is wrong."""
    named = [r.op for r in table]
    for op in sorted(set(named)):
        if named.count(op) > 1:
            raise ValueError(f"{op} has {named.count(op)} routes")
    missing = set(ops) - set(named) - set(routes.LOCAL_ONLY)
    if missing:
        raise ValueError(f"SandboxService methods without a route: {sorted(missing)}")
    for r in table:
        if r.op not in ops or r.op in routes.LOCAL_ONLY:
            raise ValueError(f"route {r.op}: not a routed SandboxService method")
        _check_route(r, ops[r.op])


def _check_route(r: Route, op: Op) -> None:
    def bad(why: str) -> ValueError:
        return ValueError(f"route {r.op}: {why}")

    placed = [*r.path_args, *r.args]
    if sorted(placed) != sorted(p.name for p in op.params):
        raise bad(f"places {sorted(placed)}, the method takes {[p.name for p in op.params]}")
    if set(r.path_args) & set(r.args):
        raise bad("an argument is both in the path and elsewhere")
    for name in r.path_args:
        if op.param(name).annotation not in ("str", "int"):
            raise bad(f"path argument {name} must be a str or an int")
    bodies = [n for n, c in r.args.items() if isinstance(c, (Body, Raw))]
    if len(bodies) > 1:
        raise bad(f"more than one body: {bodies}")
    for name, carrier in r.args.items():
        ann = op.param(name).annotation
        if isinstance(carrier, Raw) and ann != "bytes":
            raise bad(f"raw body {name} must be bytes")
        if isinstance(carrier, Body) and not _is_model(ann):
            raise bad(f"JSON body {name} must be a model")
        if isinstance(carrier, Labels) and ann != "dict[str, str] | None":
            raise bad(f"labels {name} must be dict[str, str] | None")
        if isinstance(carrier, Query) and ann not in ("str", "int", "bool"):
            raise bad(f"query argument {name} must be a str, an int or a bool")
        if name in _TAKEN:
            raise bad(f"argument name {name} is taken by the generated code")
    if not r.auth:
        raise bad("unauthenticated operations are not served (a gateway has no anonymous view)")
    if r.forward and op.params[0].name != "sandbox_id":
        raise bad("a forwarded operation's first argument must be its sandbox_id")
    if isinstance(r.reply, NoContent) != (r.status == 204):
        raise bad("no content is status 204, and 204 is no content")
    streams = isinstance(r.reply, (Events, Sse))
    if streams == op.is_async:
        raise bad("an event stream (only) is a plain def returning AsyncIterator")
    if isinstance(r.reply, Sse) and (r.forward or [type(c) for c in r.args.values()] != [Labels]):
        raise bad("server-sent events take labels only and are never forwarded")
    if isinstance(r.reply, Events) and [type(c) for c in r.args.values()] != [Body]:
        raise bad("an event stream's arguments are its path and one JSON body")
    _check_reply(r, op, bad)


def _check_reply(r: Route, op: Op, bad: Callable[[str], ValueError]) -> None:
    ret = op.returns
    if isinstance(r.reply, NoContent) and ret != "None":
        raise bad("no content returns None")
    if isinstance(r.reply, Bytes) and ret != "bytes":
        raise bad("a bytes reply returns bytes")
    if isinstance(r.reply, Events) and ret != "AsyncIterator[ExecEvent]":
        raise bad("an event stream returns AsyncIterator[ExecEvent]")
    if isinstance(r.reply, Sse) and ret != "AsyncIterator[Event]":
        raise bad("server-sent events return AsyncIterator[Event]")
    if isinstance(r.reply, Json):
        if r.reply.key is None and not (_is_model(ret) or _model_list(ret)):
            raise bad("a bare JSON reply is a model or a list of models")
        if r.reply.key is not None and not (ret == "int" or _model_list(ret)):
            raise bad("a JSON reply under a key is an int or a list of models")


# ------------------------------------------------------------ emitting


def _call(head: str, args: list[str], tail: str, indent: int) -> list[str]:
    """`head(args)tail` on one line if it fits, else one argument a line
    with a trailing comma: the two shapes ruff format keeps as they are."""
    pad = " " * indent
    line = f"{pad}{head}{', '.join(args)}{tail}"
    if len(line) <= WIDTH:
        return [line]
    return [f"{pad}{head}", *[f"{pad}    {a}," for a in args], f"{pad}{tail.lstrip(', ')}"]


def _uses(body: str, name: str) -> bool:
    """Whether `body` names `name` itself (not `x.name`, not `OtherName`)."""
    return re.search(rf"(?<![\w.]){name}\b", body) is not None


def _imports(body: str, lines: list[tuple[str, str]]) -> list[str]:
    """The import lines whose name the body uses."""
    return [line for name, line in lines if _uses(body, name)]


def _isort(name: str) -> tuple[int, str]:
    """Where ruff's isort puts an imported name: constants, then classes,
    then the rest, each group in case-insensitive order."""
    kind = 0 if name.isupper() and len(name) > 1 else 1 if name[0].isupper() else 2
    return kind, name.lower()


def _models_import(body: str) -> list[str]:
    used = (n for n in models.__all__ if _uses(body, n))
    names = sorted(used, key=_isort)
    if not names:
        return []
    one = f"from corral.api.models import {', '.join(names)}"
    if len(one) <= WIDTH:
        return [one]
    return ["from corral.api.models import (", *[f"    {n}," for n in names], ")"]


_NOTICE = """GENERATED by corral/api/gen_routes.py from api/routes.py and
api/service.py: do not edit; run `python -m corral.api.gen_routes` after
changing either."""


def _module(doc: str, stdlib: list[str], third: list[str], ours: list[str], body: str) -> str:
    """A module: its docstring, import groups in ruff's order, then `body`."""
    groups = [g for g in (stdlib, third, ours) if g]
    imports = "\n\n".join("\n".join(g) for g in groups)
    head = f'"""{doc}\n\n{_NOTICE}\n"""\n\nfrom __future__ import annotations\n\n'
    # Two blank lines before a def or a class, one before anything else.
    gap = "\n\n\n" if re.match(r"(async def|def|class) ", body) else "\n\n"
    return head + imports + gap + body.rstrip("\n") + "\n"


# ------------------------------------------------------------ api/endpoints.py


def _endpoint(r: Route, op: Op) -> list[str]:
    params = ["svc: Svc"]
    if any(isinstance(c, Raw) for c in r.args.values()):
        params.append("request: Request")
    call, pre, labelled = [], [], ""
    for p in op.params:
        carrier = r.args.get(p.name)
        if isinstance(carrier, Raw):
            limit = "MAX_BODY" if carrier.limit == routes.MAX_BODY else str(carrier.limit)
            pre.append(f"{p.name} = await read_body(request, {limit})")
            call.append(p.name)
        elif isinstance(carrier, Labels):
            labelled = f"{carrier.wire}: Annotated[builtins.list[str], Query()] = []"
            params.append(labelled)
            call.append(f"parse_labels({carrier.wire}) or None")
        else:
            params.append(p.declared())
            call.append(p.name)
    reply = r.reply
    if isinstance(reply, Json):
        returns = op.returns if reply.key is None else f"dict[str, {op.returns}]"
    elif isinstance(reply, (Events, Sse)):
        returns = "StreamingResponse"
    else:
        returns = "Response"
    invoke = f"svc.{r.op}("
    lines = [f'    @app.{r.method.lower()}("{r.path}", status_code={r.status})']
    if labelled:
        # A list default is FastAPI's idiom for a repeatable parameter; the
        # comment that allows it must stay on its line: one parameter a line.
        noqa = {labelled: "  # noqa: B006 (FastAPI idiom)"}
        lines += [
            f"    async def {r.endpoint_name}(",
            *[f"        {p},{noqa.get(p, '')}" for p in params],
        ]
        lines.append(f"    ) -> {returns}:")
    else:
        lines += _call(f"async def {r.endpoint_name}(", params, f") -> {returns}:", 4)
    lines += [f"        {s}" for s in pre]
    if isinstance(reply, Events):
        lines += _call(f"return await event_stream({invoke}", call, "))", 8)
    elif isinstance(reply, Sse):
        lines += _call(f"return sse_stream({invoke}", call, "))", 8)
    elif isinstance(reply, NoContent):
        lines += _call(f"await {invoke}", call, ")", 8)
        lines.append("        return Response(status_code=204)")
    elif isinstance(reply, Bytes):
        lines += _call(f"data = await {invoke}", call, ")", 8)
        lines.append(f'        return Response(data, media_type="{reply.media_type}")')
    elif reply.key is None:
        lines += _call(f"return await {invoke}", call, ")", 8)
    else:
        lines += _call(f"result = await {invoke}", call, ")", 8)
        lines.append(f'        return {{"{reply.key}": result}}')
    return lines


def endpoints_module() -> str:
    ops = operations()
    body = ["def add_routes(app: FastAPI) -> None:"]
    body.append('    """Every operation of the route table as an endpoint of `app`."""')
    for r in routes.ROUTES:
        body += ["", *_endpoint(r, ops[r.op])]
    text = "\n".join(body) + "\n"
    fastapi = [n for n in ("FastAPI", "Query", "Request", "Response") if _uses(text, n)]
    ours = _models_import(text)
    if _uses(text, "MAX_BODY"):
        ours.append("from corral.api.routes import MAX_BODY")
    serving = [n for n in ("Svc", "event_stream", "read_body", "sse_stream") if _uses(text, n)]
    ours.append(f"from corral.api.serving import {', '.join(serving)}")
    ours += _imports(text, [("parse_labels", "from corral.api.wire import parse_labels")])
    return _module(
        "The FastAPI endpoints of api/routes.py's operations.",
        _imports(
            text, [("builtins", "import builtins"), ("Annotated", "from typing import Annotated")]
        ),
        [
            f"from fastapi import {', '.join(fastapi)}",
            *_imports(
                text, [("StreamingResponse", "from fastapi.responses import StreamingResponse")]
            ),
        ],
        ours,
        text,
    )


# ------------------------------------------------------------ api/http.py


def _path_expr(r: Route, op: Op) -> str:
    def segment(m: re.Match[str]) -> str:
        name = m.group(1)
        if op.param(name).annotation == "int":
            return f"{{{name}}}"
        field = "" if name == "sandbox_id" else f", '{name}'"
        return f"{{ids.segment({name}{field})}}"

    path = re.sub(r"\{(\w+)\}", segment, r.path)
    return f'f"{path}"' if r.path_args else f'"{path}"'


def _client_method(r: Route, op: Op) -> list[str]:
    params = ["self", *(p.declared() for p in op.params)]
    query: list[str] = []
    labels: list[str] = []
    body: str | None = None
    for p in op.params:
        carrier = r.args.get(p.name)
        if isinstance(carrier, Query):
            query.append(f'("{p.name}", {p.name})')
        elif isinstance(carrier, Labels):
            labels.append(f'*label_pairs("{carrier.wire}", {p.name})')
        elif isinstance(carrier, Body):
            dump = "exclude_none=True" if carrier.exclude_none else ""
            body = f"json_body={p.name}.model_dump_json({dump})"
        elif isinstance(carrier, Raw):
            body = f"raw_body={p.name}"
    path = _path_expr(r, op)
    if isinstance(r.reply, Sse):
        lines = _call(f"def {r.op}(", params, f") -> {op.returns}:", 4)
        return lines + _call("return self._sse(", [path, f"[{', '.join(labels)}]"], ")", 8)
    if isinstance(r.reply, Events):
        assert body is not None  # check(): one JSON body and nothing else
        lines = _call(f"def {r.op}(", params, f") -> {op.returns}:", 4)
        json_arg = body.removeprefix("json_body=")
        return lines + _call("return self._events(", [f'"{r.method}"', path, json_arg], ")", 8)
    args = [f'"{r.method}"', path]
    if query or labels:
        items = query + labels
        flat = f"params=[{', '.join(items)}]"
        # As an argument of the split _send call (indent 12), the list is
        # split too when it would not fit, one pair a line, as ruff does.
        if 12 + len(flat) + 1 > WIDTH:
            flat = "params=[\n" + "".join(f"{' ' * 16}{i},\n" for i in items) + f"{' ' * 12}]"
        args.append(flat)
    if body is not None:
        args.append(body)
    lines = _call(f"async def {r.op}(", params, f") -> {op.returns}:", 4)
    reply = r.reply
    if isinstance(reply, NoContent):
        return lines + _call("await self._send(", args, ")", 8)
    lines += _call("resp = await self._send(", args, ")", 8)
    if isinstance(reply, Bytes):
        return [*lines, "        return resp.content"]
    assert isinstance(reply, Json)
    doc = "resp.json()" if reply.key is None else f'resp.json()["{reply.key}"]'
    listed = _model_list(op.returns)
    if listed:
        return [*lines, f"        return [{listed}.model_validate(x) for x in {doc}]"]
    if op.returns == "int":
        return [*lines, f"        return int({doc})"]
    return [*lines, f"        return {op.returns}.model_validate_json(resp.content)"]


def http_module() -> str:
    ops = operations()
    body = [
        "class HttpService(HttpTransport):",
        '    """SandboxService over HTTP, to `corral serve` or a gateway: each',
        "    method sends its route's request and reads its reply; HttpTransport",
        '    holds the connection and turns error replies back into errors."""',
    ]
    for r in routes.ROUTES:
        body += ["", *_client_method(r, ops[r.op])]
    text = "\n".join(body) + "\n"
    stdlib = _imports(
        text,
        [
            ("builtins", "import builtins"),
            ("AsyncIterator", "from collections.abc import AsyncIterator"),
        ],
    )
    ours = _imports(text, [("ids", "from corral import ids")]) + _models_import(text)
    ours.append("from corral.api.transport import HttpTransport")
    ours += _imports(text, [("label_pairs", "from corral.api.wire import label_pairs")])
    return _module("SandboxService over HTTP: the client of api/routes.py.", stdlib, [], ours, text)


# ------------------------------------------------------------ control/forwarding.py


def forwarding_module() -> str:
    ops = operations()
    body = [
        "class Forwarding(ABC):",
        '    """The operations a gateway serves by checking that the caller may',
        "    touch the sandbox and sending the call, as it came, to the node that",
        '    holds it: `_forward` does both; the rest are one call each."""',
        "",
        "    @abstractmethod",
        "    async def _forward(self, sandbox_id: str, call: "
        "Callable[[SandboxService], Awaitable[T]]) -> T:",
        '        """`call` on the service of the node that holds `sandbox_id`."""',
    ]
    for r in routes.ROUTES:
        if not r.forward:
            continue
        op = ops[r.op]
        args = ", ".join(p.name for p in op.params)
        body.append("")
        params = ["self", *(p.declared() for p in op.params)]
        body += _call(f"async def {r.op}(", params, f") -> {op.returns}:", 4)
        # A result-less operation's body is a statement, not a return.
        head = "await self._forward(" if op.returns == "None" else "return await self._forward("
        body += _call(head, ["sandbox_id", f"lambda node: node.{r.op}({args})"], ")", 8)
    text = "\n".join(body) + "\n"
    stdlib = [
        *_imports(text, [("builtins", "import builtins")]),
        "from abc import ABC, abstractmethod",
        "from collections.abc import Awaitable, Callable",
        "from typing import TypeVar",
    ]
    ours = [*_models_import(text), "from corral.api.service import SandboxService"]
    return _module(
        "What a gateway forwards to a sandbox's node, from api/routes.py.",
        stdlib,
        [],
        ours,
        'T = TypeVar("T")\n\n\n' + text,
    )


def generate() -> dict[Path, str]:
    check(routes.ROUTES, operations())
    return {
        TARGETS["endpoints"]: endpoints_module(),
        TARGETS["http"]: http_module(),
        TARGETS["forwarding"]: forwarding_module(),
    }


def main() -> int:
    stale = []
    for path, text in generate().items():
        if "--check" in sys.argv:
            if not path.exists() or path.read_text() != text:
                stale.append(path)
        else:
            path.write_text(text)
    for path in stale:
        print(f"{path} is stale: run python -m corral.api.gen_routes", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
