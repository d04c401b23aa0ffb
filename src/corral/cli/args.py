"""From parsed arguments to what the commands need: the sandbox flags and
the create() arguments they map to, the command after `--`, and the client
and node config the global flags pick.

The parser (main) and the command modules both use these, so they live
here: main imports the command modules, never the other way round.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from corral.config import NodeConfig
from corral.errors import InvalidArgument
from corral.sdk.client import AsyncClient


def parse_labels(items: list[str] | None) -> dict[str, str]:
    """Repeated key=value flags (--label, --env) as a dict."""
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise InvalidArgument("label", "must be key=value", item)
        out[key] = value
    return out


def add_burst_args(p: argparse.ArgumentParser) -> None:
    """A gateway's burst targets (`serve --gateway` and `cluster up`)."""
    p.add_argument(
        "--burst-targets", type=Path,
        help="a JSON file of other Corral gateways to spill creates to (docs/bursting.md)",
    )  # fmt: skip
    p.add_argument(
        "--burst-threshold", type=float, default=0.8,
        help="burst when this share of the local slots or memory is in use",
    )  # fmt: skip


def add_sandbox_args(p: argparse.ArgumentParser) -> None:
    """The flags of `create` and `run`; create_kwargs reads them back."""
    p.add_argument("--kind", default="container", help="container, microvm or fullvm")
    p.add_argument("--image", required=True, help="base image, name:tag or sha256:...")
    p.add_argument("--workspace", help="workspace layer composed over the image")
    p.add_argument("--toolkit", action="append", help="toolkit layer (repeatable; last on top)")
    p.add_argument("--cpu", type=float, default=None, help="cores (default 1; fullvm 2)")
    p.add_argument("--memory", default=None, help="default 1GiB; fullvm 2GiB")
    p.add_argument("--display-size", default=None, help="fullvm: WIDTHxHEIGHT (1024x768)")
    p.add_argument("--disk", default="2GiB")
    p.add_argument("--pids", type=int, default=512)
    p.add_argument("--ttl", type=float, default=3600)
    p.add_argument("--idle-timeout", type=float, default=600)
    p.add_argument("--env", action="append", help="KEY=VALUE (repeatable)")
    p.add_argument("--label", action="append", help="key=value (repeatable)")


def create_kwargs(a: argparse.Namespace) -> dict[str, Any]:
    """The sandboxes.create() arguments of add_sandbox_args' flags."""
    return {
        "kind": a.kind,
        "display_size": a.display_size,
        "image": a.image,
        "workspace": a.workspace,
        "toolkit": a.toolkit,
        "cpu": a.cpu,
        "memory": a.memory,
        "disk": a.disk,
        "pids": a.pids,
        "ttl": a.ttl,
        "idle_timeout": a.idle_timeout,
        "env": parse_labels(a.env),
        "labels": parse_labels(a.label),
    }


def given_command(parts: list[str]) -> str | list[str]:
    """The command after `--`: one word is a shell line, more are an argv."""
    if not parts:
        raise InvalidArgument("cmd", "must be given after --", parts)
    return parts[0] if len(parts) == 1 else parts


def open_client(a: argparse.Namespace) -> AsyncClient:
    """A client of --url, or of an embedded node agent without one."""
    return AsyncClient(a.url, api_key=a.api_key, data_dir=a.data_dir)


def node_config(a: argparse.Namespace) -> NodeConfig:
    """This host's node config, for the commands that act on it directly."""
    return NodeConfig.from_env(data_dir=a.data_dir)
