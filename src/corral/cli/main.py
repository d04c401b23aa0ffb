"""`corral`: the command line. Human output by default, --json for scripts.

Every command works embedded (a node agent in this process, root needed) or
against a server (--url or CORRAL_URL).

This module is the parser; the handlers live in cli.sandboxes, cli.images,
cli.cluster and cli.node, which never import it back.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from corral.cli import cluster, disks, images, node, sandboxes, tasks
from corral.cli.args import add_burst_args, add_sandbox_args
from corral.errors import CorralError
from corral.log import configure
from corral.version import __version__

Handler = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="corral", description="Sandboxes for agent RL.")
    parser.add_argument("--version", action="version", version=f"corral {__version__}")
    parser.add_argument(
        "--url",
        default=os.environ.get("CORRAL_URL"),
        help="a corral server (http://host:7070 or unix:/path); default embedded",
    )
    parser.add_argument("--api-key", default=os.environ.get("CORRAL_API_KEY"))
    parser.add_argument("--data-dir", default=None, help="node data dir (default /var/lib/corral)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    sub = parser.add_subparsers(dest="command", required=True)

    def cmd(name: str, handler: Handler | None, help: str) -> argparse.ArgumentParser:
        """A subcommand; a group (None) gets no handler of its own, as its
        required subcommands each set theirs."""
        p = sub.add_parser(name, help=help, description=help)
        if handler is not None:
            p.set_defaults(handler=handler)
        return p

    p = cmd("serve", node.serve, "run the node agent (or, with --gateway, a gateway) over HTTP")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7070)
    p.add_argument("--socket", help="also listen on this unix socket")
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--gateway",
        action="store_true",
        help="serve as a gateway over the node agents heartbeating into --state",
    )
    p.add_argument(
        "--state",
        default=os.environ.get("CORRAL_STATE"),
        help="a cluster's state store: postgresql://... or sqlite:///PATH; a node agent "
        "given one heartbeats into it",
    )
    p.add_argument("--node", default=None, help="this node agent's name ([a-z0-9]{1,16})")
    p.add_argument("--advertise", help="the URL gateways reach this node at")
    p.add_argument(
        "--node-key",
        default=os.environ.get("CORRAL_NODE_KEY"),
        help="gateway: the key node agents require (theirs is --api-key)",
    )
    p.add_argument("--node-timeout", type=float, default=10.0, help="gateway: silence = lost")
    add_burst_args(p)

    proj = cmd("project", None, "projects (org / team / job), quotas and API keys")
    psub = proj.add_subparsers(dest="project_command", required=True)
    p = psub.add_parser("create", help="create a project, nested under --parent")
    p.set_defaults(handler=cluster.project_create)
    p.add_argument("name")
    p.add_argument("--parent")
    p.add_argument("--max-sandboxes", type=int)
    p.add_argument("--max-cpu", type=float)
    p.add_argument("--max-memory", help="e.g. 64GiB")
    p.add_argument(
        "--operator", action="store_true",
        help="its keys see every node and project (dashboard, the gateway's metrics)",
    )  # fmt: skip
    p = psub.add_parser("ls", help="list projects with their use and limits")
    p.set_defaults(handler=cluster.project_ls)
    p = psub.add_parser("key", help="make an API key for a project (printed once)")
    p.set_defaults(handler=cluster.project_key)
    p.add_argument("name")
    p.add_argument("--expires", help="e.g. 30d, 12h, or 2027-06-30 (default: never)")
    p.add_argument("--note", help="what the key is for, shown by `project keys`")
    p = psub.add_parser("keys", help="list API keys (ids, expiry, revocation, last use)")
    p.set_defaults(handler=cluster.project_keys)
    p.add_argument("name", nargs="?", help="this project's only (default: all)")
    p = psub.add_parser("revoke", help="revoke an API key, by its id or the key itself")
    p.set_defaults(handler=cluster.project_revoke)
    p.add_argument("key")
    for p in psub.choices.values():
        p.add_argument("--state", default=os.environ.get("CORRAL_STATE"), help="state store URL")
        p.add_argument("--cluster-dir", type=Path, default=Path("/var/lib/corral/cluster"))

    clu = cmd("cluster", None, "Corral on a Ray cluster: up, status, down")
    csub = clu.add_subparsers(dest="cluster_command", required=True)
    p = csub.add_parser("up", help="start the state store, node agents on Ray, the gateway")
    p.set_defaults(handler=cluster.cluster_up)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--local-nodes", type=int, help="start a Ray cluster of N nodes on this machine"
    )
    where.add_argument("--ray-address", help="use a running Ray cluster (host:port)")
    p.add_argument("--state", help="use this PostgreSQL instead of starting one")
    p.add_argument("--ray-port", type=int, default=6390)
    p.add_argument("--pg-port", type=int, default=5433)
    p.add_argument("--gateway-host", default="127.0.0.1")
    p.add_argument("--gateway-port", type=int, default=7070)
    p.add_argument("--node-port", type=int, default=7100, help="first node agent's port")
    p.add_argument(
        "--dns-port", type=int, default=10053,
        help="first node's DNS port (sandboxes' resolver; one per node, UDP and TCP)",
    )  # fmt: skip
    p.add_argument("--node-timeout", type=float, default=10.0)
    p.add_argument(
        "--timeout", type=float, default=180.0,
        help="seconds to wait for every node agent and the gateway to answer",
    )  # fmt: skip
    p.add_argument("--images", type=Path, help="a layer store the local nodes share")
    p.add_argument(
        "--blobs",
        help="the blob store nodes fetch images they lack from: a directory, http(s):// of "
        "`corral blobd`, or s3:// (default with --local-nodes: this machine's image store)",
    )
    add_burst_args(p)
    p = csub.add_parser("status", help="the nodes and their last heartbeat")
    p.set_defaults(handler=cluster.cluster_status)
    p = csub.add_parser("down", help="close every sandbox, stop what up started")
    p.set_defaults(handler=cluster.cluster_down)
    for p in csub.choices.values():
        p.add_argument("--dir", type=Path, default=Path("/var/lib/corral/cluster"))

    p = cmd("create", sandboxes.create, "create a sandbox and print its id")
    add_sandbox_args(p)

    p = cmd("screenshot", sandboxes.screenshot, "save a full VM's screen as a PNG")
    p.add_argument("id")
    p.add_argument("-o", "--output", type=Path, help="file to write (default: ID.png)")

    p = cmd("view", sandboxes.view, "print the URL of a full VM's live view (noVNC)")
    p.add_argument("id")
    p.add_argument("--interactive", action="store_true", help="let the viewer type and click")
    p.add_argument("--ttl", type=int, default=300, help="seconds the URL works (at most 3600)")

    p = cmd("suspend", sandboxes.suspend, "save a VM sandbox to disk and stop it")
    p.add_argument("id")
    p = cmd("resume", sandboxes.resume, "bring a suspended sandbox back")
    p.add_argument("id")

    p = cmd("exec", sandboxes.exec_, "run a command in a sandbox; exits with its status")
    p.add_argument("id")
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--cwd")
    p.add_argument("--user", default="root")
    p.add_argument("cmd", nargs="*", help="the command (after --)")

    p = cmd("run", sandboxes.run, "create a sandbox, run one command, close it")
    add_sandbox_args(p)
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("cmd", nargs="*", help="the command (after --)")

    p = cmd("call", sandboxes.call, "run code as a stateless function call; exits with its status")
    p.add_argument("language", help="python, bash, c, cpp, ... (see docs/fncall.md)")
    p.add_argument("source", help="a file with the code, or - for standard input")
    p.add_argument("--stdin", type=Path, help="a file fed to the program's standard input")
    p.add_argument(
        "--file", action="append", type=Path, default=[], help="also put this file in /work"
    )
    p.add_argument("--fetch", action="append", default=[], help="print this file of /work after")
    p.add_argument("--timeout", type=float, default=10.0, help="run timeout (s)")
    p.add_argument("--compile-timeout", type=float, default=10.0)
    p.add_argument("--memory", default="512MiB")
    p.add_argument("--image")

    p = cmd("ls", sandboxes.ls, "list live sandboxes")
    p.add_argument("--label", action="append")

    p = cmd("rm", sandboxes.rm, "close sandboxes")
    p.add_argument("ids", nargs="+")

    cmd("gc", node.gc, "reclaim leftovers of crashed agents and sandboxes (embedded only)")
    cmd("doctor", node.doctor, "check what this host offers Corral")

    p = cmd("demo", node.demo, "the main job: a batch of agent rollouts on real projects")
    p.add_argument("part", nargs="?", choices=["all", "rl"], default="all",
                   help="rl: only the RL episodes through the gymnasium adapter")  # fmt: skip
    p.add_argument("--sandboxes", type=int, default=48)

    p = cmd("bench", node.bench, "run a benchmark from bench/")
    p.add_argument("name", nargs="?")
    p.add_argument("args", nargs=argparse.REMAINDER)

    tsk = cmd("tasks", None, "run tasks in harbor's (terminal-bench's) format")
    tsub = tsk.add_subparsers(dest="tasks_command", required=True)
    p = tsub.add_parser("run", help="run a task directory, or a directory of tasks")
    p.set_defaults(handler=tasks.tasks_run)
    p.add_argument("path", type=Path)
    p.add_argument("--agent", choices=["oracle", "nop"], default="oracle")
    p.add_argument("--agent-cmd", help="instead: an agent that is this command in the sandbox")
    p.add_argument("-n", "--concurrency", type=int, default=8)
    p.add_argument("-k", "--attempts", type=int, default=1, help="trials per task")

    dsk = cmd("disk", None, "users' own VM disks (qcow2, raw), booted as image disk:NAME")
    dsub = dsk.add_subparsers(dest="disk_command", required=True)
    p = dsub.add_parser("add", help="copy a qcow2 or raw disk in (checked, read-only)")
    p.set_defaults(handler=disks.disk_add)
    p.add_argument("path", type=Path)
    p.add_argument("--name", help="what sandboxes call it (disk:NAME); default: the file's name")
    p.add_argument(
        "--project",
        help="one cluster project's own (disk:projects/PROJECT/NAME): only its keys boot it; "
        "without, every project may",
    )
    p = dsub.add_parser("ls", help="list this host's disks")
    p.set_defaults(handler=disks.disk_ls)
    p = dsub.add_parser("rm", help="remove disks (running sandboxes keep theirs open)")
    p.set_defaults(handler=disks.disk_rm)
    p.add_argument("names", nargs="+")

    img = cmd("image", None, "build and manage image layers")
    isub = img.add_subparsers(dest="image_command", required=True)
    p = isub.add_parser("build", help="build a layer")
    p.set_defaults(handler=images.image_build)
    p.add_argument("ref", help="name:tag")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-dir", type=Path)
    src.add_argument("--from-tar", type=Path, help="a root file system tarball")
    src.add_argument("--debootstrap", metavar="SUITE")
    src.add_argument(
        "--desktop",
        nargs="?",
        const="twm",
        choices=["twm", "xfce"],
        help="Corral's full-VM desktop, REF its base: twm (small; toolkit corral-desktop:latest) "
        "or xfce (XFCE, Chromium, Firefox, LibreOffice; toolkit corral-xfce:latest)",
    )
    src.add_argument(
        "--from-oci",
        type=Path,
        metavar="ARCHIVE",
        help="an OCI image layout (dir or tar) or a `docker save` tarball",
    )
    src.add_argument(
        "--run", metavar="BASE", help="start a sandbox on BASE, run CMD, keep what it changed"
    )
    src.add_argument(
        "-f", "--file", type=Path, metavar="DOCKERFILE",
        help="build a Dockerfile, each step in a sandbox: image build REF -f DOCKERFILE [CONTEXT]",
    )  # fmt: skip
    p.add_argument("--build-arg", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--no-cache", action="store_true", help="with -f: run every step again")
    p.add_argument("--packages", default="", help="with --debootstrap: p1,p2")
    p.add_argument("--kind", default=None, choices=["base", "workspace", "toolkit", "layer"])
    p.add_argument("--workspace", help="with --run: workspace layer of the build sandbox")
    p.add_argument("--toolkit", action="append", help="with --run: toolkit layers")
    p.add_argument("--timeout", type=float, default=3600, help="with --run: seconds for CMD")
    p.add_argument("cmd", nargs="*", help="with --run: -- CMD ...; with -f: the CONTEXT (.)")
    p = isub.add_parser("import", help="import a root file system tarball")
    p.set_defaults(handler=images.image_import)
    p.add_argument("tarball", type=Path)
    p.add_argument("ref")
    p.add_argument("--kind", default="base")
    p = isub.add_parser("ls", help="list layers")
    p.set_defaults(handler=images.image_ls)
    p = isub.add_parser("inspect", help="show a layer's manifest")
    p.set_defaults(handler=images.image_inspect)
    p.add_argument("ref")
    p = isub.add_parser("rm", help="untag a layer (gc frees it)")
    p.set_defaults(handler=images.image_rm)
    p.add_argument("refs", nargs="+")
    p = isub.add_parser("push", help="push an image to an OCI registry, or a layer to a store")
    p.set_defaults(handler=images.image_push)
    p.add_argument("ref")
    p.add_argument("store", help="HOST[:PORT]/REPO:TAG (a registry), a directory, "
                   "a `corral blobd` http(s)://host:port or s3://bucket/prefix "
                   "(a node's /blobs is read only)")  # fmt: skip
    p.add_argument("--authfile", type=Path, help="docker login-style credentials (registry)")
    p = isub.add_parser(
        "pull",
        help="pull an image from an OCI registry (REF only), or register a layer from a "
        "shared store (REF STORE: data loads lazily)",
    )
    p.set_defaults(handler=images.image_pull)
    p.add_argument("ref", help="HOST[:PORT]/REPO[:TAG|@DIGEST], or a layer name:tag with STORE")
    p.add_argument("store", nargs="?")
    p.add_argument("--eager", action="store_true", help="download all data now (STORE)")
    p.add_argument("--authfile", type=Path, help="docker login-style credentials (registry)")
    p.add_argument("--platform", default="linux/amd64", help="of a manifest list (registry)")
    p = isub.add_parser("gc", help="drop untagged layers no sandbox uses, and orphan blobs")
    p.set_defaults(handler=images.image_gc)

    p = cmd("blobd", node.blobd, "serve a directory as an HTTP blob store (ranged reads)")
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=7071)
    p.add_argument("--rate", default=None, help="cap on bytes/s sent, e.g. 100MB")
    return parser


def main(argv: list[str] | None = None) -> int:
    configure(os.environ.get("CORRAL_LOG_LEVEL"))
    # Everything after the first `--` is the command to run, whatever the
    # subcommand's options around it (argparse cannot tell them apart).
    argv = list(sys.argv[1:] if argv is None else argv)
    tail: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, tail = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `image build REF -f DOCKERFILE CONTEXT`: the context comes after the
    # options, where argparse has no positional left to give it.
    if extra and getattr(args, "file", None) is not None and not extra[0].startswith("-"):
        args.cmd, extra = [*(args.cmd or []), extra[0]], extra[1:]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if hasattr(args, "cmd"):
        args.cmd = (args.cmd or []) + tail
    try:
        with asyncio.Runner(loop_factory=_loop_factory(args)) as runner:
            code: int = runner.run(args.handler(args))
        return code
    except CorralError as err:
        if args.json:
            print(json.dumps({"error": err.to_wire()}), file=sys.stderr)
        else:
            print(f"corral: {err.code}: {err.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _loop_factory(args: argparse.Namespace) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop for a gateway: it is all network I/O (HTTP in, HTTP and
    PostgreSQL out), where uvloop costs about a third less CPU. Node agents
    keep asyncio's loop: they reap their own children (subreaper), which
    libuv's child watcher would race."""
    if getattr(args, "gateway", False):
        try:
            import uvloop

            return uvloop.new_event_loop
        except ImportError:
            pass
    return None


if __name__ == "__main__":
    sys.exit(main())
