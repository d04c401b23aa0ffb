"""The route table is the API's one description: every operation has a
row, and the three surfaces built from it (the FastAPI app, HttpService,
the gateway's forwarding) say exactly what the table says. Also the layer
rules and module sizes of api, control and sdk (docs/api.md)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
from fastapi.routing import APIRoute

from corral.api import gen_routes, routes
from corral.api.app import create_app
from corral.api.http import HttpService
from corral.api.routes import BY_OP, LOCAL_ONLY, ROUTES, Body, Json, NoContent, Query, Raw
from corral.api.service import SandboxService
from corral.control.forwarding import Forwarding
from corral.control.view import GatewayView

SRC = Path(gen_routes.__file__).parents[1]
GENERATED = {"sdk/sync.py", "api/endpoints.py", "api/http.py", "control/forwarding.py"}


def _service_methods() -> set[str]:
    return {n for n, v in vars(SandboxService).items() if inspect.isfunction(v) and n[0] != "_"}


def _signature(fn: Any) -> list[tuple[str, Any, Any]]:
    sig = inspect.signature(fn)
    return [(p.name, p.annotation, p.default) for p in sig.parameters.values()] + [
        ("->", sig.return_annotation, None)
    ]


def test_every_service_method_has_exactly_one_route_or_is_local_only() -> None:
    ops = [r.op for r in ROUTES]
    assert len(ops) == len(set(ops)), "an operation has two routes"
    assert set(ops).isdisjoint(LOCAL_ONLY)
    assert set(ops) | set(LOCAL_ONLY) == _service_methods()


def test_every_route_needs_a_key_and_places_each_argument_once() -> None:
    gen_routes.check(ROUTES, gen_routes.operations())
    assert all(r.auth for r in ROUTES)


def _broken(op: str, **change: Any) -> tuple[routes.Route, ...]:
    return tuple(dataclasses.replace(r, **change) if r.op == op else r for r in ROUTES)


@pytest.mark.parametrize(
    ("table", "why"),
    [
        (
            tuple(r for r in ROUTES if r.op != "rollout_delete"),
            "without a route: ['rollout_delete']",
        ),
        (_broken("exec", reply=routes.Sse()), "labels only and are never forwarded"),
        (_broken("events", reply=routes.Events()), "one JSON body"),
        (_broken("audit", reply=routes.Sse()), "plain def"),
        ((*ROUTES, ROUTES[0]), "create has 2 routes"),
        (_broken("read_file", args={"path": Query()}), "places"),
        (
            _broken("read_file", args={"path": Query(), "user": Raw(), "follow_symlinks": Query()}),
            "must be bytes",
        ),
        (_broken("commit", args={"req": Query()}), "query argument req"),
        (
            _broken(
                "write_file",
                args={
                    "path": Body(),
                    "data": Raw(),
                    "user": Query(),
                    "mode": Query(),
                    "follow_symlinks": Query(),
                },
            ),
            "more than one body",
        ),
        (_broken("close", status=200), "204"),
        (_broken("get", reply=NoContent(), status=204), "no content returns None"),
        (_broken("write_file", reply=Json()), "bare JSON reply"),
        (_broken("close", reply=Json(), status=200), "bare JSON reply"),  # None is no model
        (_broken("run_call", forward=True), "sandbox_id"),
        (_broken("get", auth=False), "unauthenticated"),
        (_broken("exec", args={"req": Raw()}), "raw body req must be bytes"),
    ],
)
def test_a_table_that_disagrees_with_the_service_is_refused(
    table: tuple[routes.Route, ...], why: str
) -> None:
    with pytest.raises(ValueError, match=why.replace("[", r"\[").replace("]", r"\]")):
        gen_routes.check(table, gen_routes.operations())


def test_the_app_serves_the_table_and_its_own_extras_only() -> None:
    app = create_app(object())  # type: ignore[arg-type]
    served = {
        (next(iter(r.methods)), r.path, r.name, r.status_code or 200)
        for r in app.routes
        if isinstance(r, APIRoute)
    }
    table = {(r.method, r.path, r.endpoint_name, r.status) for r in ROUTES}
    extras = {
        ("GET", "/healthz", "healthz", 200),
        ("GET", "/metrics", "prometheus", 200),
        ("POST", "/run_code", "run_code", 200),
        ("POST", "/v1/run_code", "run_code", 200),
        ("GET", "/v1/ping", "ping", 200),
        ("POST", "/run_jupyter", "run_jupyter", 200),
        ("POST", "/v1/run_jupyter", "run_jupyter", 200),
    }
    assert served == table | extras


def test_the_app_documents_request_and_response_models() -> None:
    spec = create_app(object()).openapi()  # type: ignore[arg-type]
    create = spec["paths"]["/v1/sandboxes"]["post"]
    body = create["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CreateSandbox"}
    reply = create["responses"]["201"]["content"]["application/json"]["schema"]
    assert reply == {"$ref": "#/components/schemas/SandboxInfo"}
    assert {"ExecRequest", "FnCallResult", "SavedState", "NetworkPolicy"} <= set(
        spec["components"]["schemas"]
    )


def test_http_service_implements_every_routed_operation_with_its_signature() -> None:
    for r in ROUTES:
        method = vars(HttpService).get(r.op)
        assert method is not None, f"HttpService.{r.op} is missing"
        assert _signature(method) == _signature(getattr(SandboxService, r.op)), r.op
    assert {"start", "aclose"} <= set(dir(HttpService))


def test_the_gateway_forwards_the_forwardable_and_writes_the_rest_itself() -> None:
    forwarded = {r.op for r in ROUTES if r.forward}
    generated = {n for n, v in vars(Forwarding).items() if inspect.isfunction(v) and n[0] != "_"}
    assert generated == forwarded
    own = {
        n
        for cls in GatewayView.__mro__
        if cls not in (Forwarding, object)
        for n, v in vars(cls).items()
        if inspect.isfunction(v) and n[0] != "_"
    }
    assert own == _service_methods() - forwarded, "GatewayView overrides a forwarded op"
    for op in BY_OP:
        assert _signature(getattr(GatewayView, op)) == _signature(getattr(SandboxService, op)), op


def test_committed_generated_modules_are_what_the_generator_writes() -> None:
    for path, text in gen_routes.generate().items():
        assert path.read_text() == text, f"{path} is stale: run python -m corral.api.gen_routes"


# ------------------------------------------------------------------ layers


def _imports(path: Path) -> set[str]:
    """Every corral module `path` imports, wherever the import is (module
    level, under TYPE_CHECKING, inside a function): a circle is a circle."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("corral.")}


def _modules(part: str) -> dict[str, Path]:
    return {
        f"corral.{part}." + ".".join(p.relative_to(SRC / part).with_suffix("").parts): p
        for p in (SRC / part).rglob("*.py")
    }


@pytest.mark.parametrize(
    ("part", "below_it_not"),
    [("api", ("node", "control", "sdk")), ("control", ("sdk",))],
)
def test_a_layer_imports_only_the_layers_below_it(part: str, below_it_not: tuple[str, ...]) -> None:
    for name, path in _modules(part).items():
        for target in _imports(path):
            layer = target.split(".")[1]
            assert layer not in below_it_not, f"{name} imports {target}"


def test_the_sdk_has_no_import_circle() -> None:
    mods = _modules("sdk")
    edges = {m: {t for t in _imports(p) if t in mods and t != m} for m, p in mods.items()}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(
            t == goal or (t not in seen and reaches(t, goal, seen | {t})) for t in edges[start]
        )

    circles = sorted(m for m in mods if reaches(m, m, {m}))
    assert circles == []


@pytest.mark.parametrize("part", ["api", "control", "sdk"])
def test_no_hand_written_module_passes_600_lines(part: str) -> None:
    for path in (SRC / part).rglob("*.py"):
        if str(path.relative_to(SRC)) not in GENERATED:
            assert len(path.read_text().splitlines()) <= 600, path
