"""The HTTP wire, once: one row per SandboxService operation.

A row says how the operation's arguments travel (a path segment named in
the template, a query parameter, the JSON body, the raw body), what comes
back and with which status, whether the caller must hold a key, and whether
a gateway serves it by forwarding it, unchanged, to the node that holds the
sandbox. The argument names, types and defaults are the ones SandboxService
declares (api/service.py); a row only places them.

From this table, `python -m corral.api.gen_routes` writes the FastAPI
endpoints (api/endpoints.py), the HTTP client (api/http.py) and the
gateway's forwarding (control/forwarding.py); tests/unit/test_routes.py
checks that the three agree with the table and the table with the service.
The wire is frozen: a row's verb, path, names and status are what clients
already send and expect.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

# The largest raw body a server reads (a file, a tar archive): the node's
# default max_file_bytes, refused by Content-Length before a byte is read.
MAX_BODY = 256 << 20

# ------------------------------------------------------------ how arguments travel


@dataclass(frozen=True)
class Query:
    """A query parameter named as the argument (`?path=/etc&user=root`)."""


@dataclass(frozen=True)
class Labels:
    """A dict[str, str] as the repeated query parameter `wire`, each
    ``key=value`` (`?label=job=7&label=team=rl`); none given is None."""

    wire: str = "label"


@dataclass(frozen=True)
class Body:
    """The argument (a model) as the JSON request body. With `exclude_none`,
    fields that are None are left out rather than sent as null (so a server
    that predates an optional field still accepts the request)."""

    exclude_none: bool = False


@dataclass(frozen=True)
class Raw:
    """The argument (bytes) as the request body, refused beyond `limit`."""

    limit: int = MAX_BODY


Carrier = Query | Labels | Body | Raw

# ------------------------------------------------------------ what comes back


@dataclass(frozen=True)
class Json:
    """The result as JSON: a model, a list of models, or an int; under `key`
    (``{"sandboxes": [...]}``) or, without one, bare."""

    key: str | None = None


@dataclass(frozen=True)
class Bytes:
    """The result (bytes) as the response body."""

    media_type: str


@dataclass(frozen=True)
class NoContent:
    """Nothing: status 204, an empty body."""


@dataclass(frozen=True)
class Events:
    """A command's events as NDJSON, one per line (started, stdout/stderr
    with base64 data, exit; or an error event if it fails mid-stream). The
    server awaits the first event before answering, so an error before the
    command starts is a plain HTTP error, not a 200 with an error inside."""


@dataclass(frozen=True)
class Sse:
    """The node's events from now on as Server-Sent Events (`data:` lines
    of Event JSON, a comment line to keep idle connections open), until the
    caller hangs up. Never forwarded: a gateway merges its nodes' streams."""


Reply = Json | Bytes | NoContent | Events | Sse


@dataclass(frozen=True)
class Route:
    op: str  # the SandboxService method
    method: Literal["GET", "POST", "PUT", "DELETE"]
    path: str  # {name} segments are arguments of the same name
    reply: Reply
    # Every argument not in the path: how it travels.
    args: dict[str, Carrier] = field(default_factory=dict)
    status: int = 200
    # The caller's key is checked (on a gateway it also picks the caller's
    # project). No route is open today: /healthz and /metrics are not
    # operations and stay in app.py.
    auth: bool = True
    # A gateway sends it, as it came, to the node the sandbox id names
    # (after checking the caller may touch that sandbox). False: the
    # gateway implements it itself (control/view.py).
    forward: bool = False
    # The endpoint's name, which OpenAPI makes its operationId and summary,
    # where it was published as other than the operation's.
    endpoint: str | None = None

    @property
    def path_args(self) -> tuple[str, ...]:
        return tuple(re.findall(r"\{(\w+)\}", self.path))

    @property
    def endpoint_name(self) -> str:
        return self.endpoint or self.op


_SBX = "/v1/sandboxes/{sandbox_id}"
_Q = Query()

ROUTES: tuple[Route, ...] = (
    Route("create", "POST", "/v1/sandboxes", Json(), {"req": Body()}, status=201),
    Route("get", "GET", _SBX, Json(), forward=True),
    Route(
        "list",
        "GET",
        "/v1/sandboxes",
        Json("sandboxes"),
        {"labels": Labels()},
        endpoint="list_sandboxes",
    ),
    Route("close", "DELETE", _SBX, NoContent(), status=204),
    Route("exec", "POST", f"{_SBX}/exec", Events(), {"req": Body()}, endpoint="exec_command"),
    Route(
        "kill",
        "POST",
        f"{_SBX}/commands/{{pid}}/kill",
        NoContent(),
        {"signal": _Q},
        status=204,
        forward=True,
    ),
    Route(
        "resize_pty",
        "POST",
        f"{_SBX}/commands/{{pid}}/pty",
        NoContent(),
        {"rows": _Q, "cols": _Q},
        status=204,
        forward=True,
    ),
    Route(
        "send_stdin",
        "POST",
        f"{_SBX}/commands/{{pid}}/stdin",
        NoContent(),
        {"data": Raw(limit=16 << 20), "eof": _Q},
        status=204,
        forward=True,
    ),
    Route(
        "read_file",
        "GET",
        f"{_SBX}/files",
        Bytes("application/octet-stream"),
        {"path": _Q, "user": _Q, "follow_symlinks": _Q},
        forward=True,
    ),
    Route(
        "write_file",
        "PUT",
        f"{_SBX}/files",
        Json("bytes"),
        {"path": _Q, "data": Raw(), "user": _Q, "mode": _Q, "follow_symlinks": _Q},
        forward=True,
    ),
    Route(
        "list_files",
        "GET",
        f"{_SBX}/files/list",
        Json("entries"),
        {"path": _Q, "user": _Q},
        forward=True,
    ),
    Route("stat_file", "GET", f"{_SBX}/files/stat", Json(), {"path": _Q, "user": _Q}, forward=True),
    Route(
        "make_dir",
        "POST",
        f"{_SBX}/files/mkdir",
        NoContent(),
        {"path": _Q, "user": _Q},
        status=204,
        forward=True,
    ),
    Route(
        "set_xattrs",
        "POST",
        f"{_SBX}/files/xattrs",
        NoContent(),
        {"req": Body()},
        status=204,
        forward=True,
    ),
    Route(
        "remove_file",
        "DELETE",
        f"{_SBX}/files",
        NoContent(),
        {"path": _Q, "user": _Q, "recursive": _Q},
        status=204,
        forward=True,
    ),
    Route(
        "upload_tar",
        "PUT",
        f"{_SBX}/tar",
        NoContent(),
        {"path": _Q, "data": Raw()},
        status=204,
        forward=True,
    ),
    Route(
        "download_tar", "GET", f"{_SBX}/tar", Bytes("application/x-tar"), {"path": _Q}, forward=True
    ),
    Route("commit", "POST", f"{_SBX}/commit", Json(), {"req": Body()}),
    Route("direct", "POST", f"{_SBX}/direct", Json(), {"ttl": _Q}),
    Route("audit", "GET", f"{_SBX}/audit", Json(), forward=True),
    Route("protect", "POST", f"{_SBX}/protect", Json(), {"req": Body()}, forward=True),
    Route("usage", "GET", f"{_SBX}/usage", Json(), forward=True),
    Route(
        "command_log",
        "GET",
        f"{_SBX}/commands/log",
        Json("lines"),
        {"since_ms": _Q, "limit": _Q},
        forward=True,
    ),
    Route("list_layers", "GET", "/v1/layers", Json("layers"), {"labels": Labels()}),
    Route("delete_layer", "DELETE", "/v1/layers", NoContent(), {"ref": _Q}, status=204),
    Route("suspend", "POST", f"{_SBX}/suspend", Json(), {"mode": _Q, "key": _Q}, forward=True),
    Route("resume", "POST", f"{_SBX}/resume", Json(), forward=True),
    Route("set_ttl", "PUT", f"{_SBX}/ttl", Json(), {"ttl": _Q}, forward=True),
    Route("update_network", "PUT", f"{_SBX}/network", Json(), {"policy": Body()}, forward=True),
    Route("fork", "POST", f"{_SBX}/fork", Json(), {"req": Body(exclude_none=True)}),
    Route("save", "POST", f"{_SBX}/save", Json(), {"req": Body()}, forward=True),
    Route("restore", "POST", "/v1/restore", Json(), {"req": Body(exclude_none=True)}),
    Route(
        "screenshot",
        "GET",
        f"{_SBX}/display/screenshot",
        Bytes("image/png"),
        {"percent": _Q, "x": _Q, "y": _Q, "width": _Q, "height": _Q},
        forward=True,
    ),
    Route("display_state", "GET", f"{_SBX}/display", Json(), forward=True),
    Route("display_windows", "GET", f"{_SBX}/display/windows", Json("windows"), forward=True),
    Route("display_apps", "GET", f"{_SBX}/display/apps", Json("apps"), forward=True),
    Route(
        "display_view",
        "POST",
        f"{_SBX}/display/view",
        Json(),
        {"interactive": _Q, "ttl": _Q},
        forward=True,
    ),
    Route(
        "display_launch",
        "POST",
        f"{_SBX}/display/launch",
        Json(),
        {"req": Body()},
        forward=True,
    ),
    Route(
        "display_input",
        "POST",
        f"{_SBX}/display/input",
        NoContent(),
        {"req": Body(exclude_none=True)},
        status=204,
        forward=True,
    ),
    Route("run_call", "POST", "/v1/fncall", Json(), {"req": Body()}),
    Route("rollout_steps", "GET", "/v1/rollouts/{rollout}/steps", Json("steps")),
    Route(
        "rollout_append",
        "POST",
        "/v1/rollouts/{rollout}/steps",
        NoContent(),
        {"step": Body()},
        status=204,
    ),
    Route("rollout_delete", "DELETE", "/v1/rollouts/{rollout}", NoContent(), status=204),
    Route("rollout_report", "GET", "/v1/rollouts/{rollout}/report", Json()),
    Route("events", "GET", "/v1/events", Sse(), {"labels": Labels()}),
    # A cluster's API keys, managed by their holders (control/keys.py).
    Route("create_key", "POST", "/v1/keys", Json(), {"req": Body()}, status=201),
    Route("list_keys", "GET", "/v1/keys", Json("keys"), {"project": _Q}),
    Route("revoke_key", "DELETE", "/v1/keys/{key_id}", Json()),
)

# SandboxService methods with no route: each side starts and closes its own.
LOCAL_ONLY = ("start", "aclose")

BY_OP = {r.op: r for r in ROUTES}
