"""`corral serve/gc/doctor/blobd/bench/demo`: this host's node agent (or a
gateway, or a blob store) and the tools run on the host itself."""

from __future__ import annotations

import argparse
import asyncio
import os
import runpy
import shutil
import sys
from pathlib import Path
from typing import Any

from rich.table import Table

from corral.cli.args import node_config
from corral.cli.output import emit
from corral.config import NodeConfig
from corral.errors import InvalidArgument
from corral.units import parse_size


async def serve(a: argparse.Namespace) -> int:
    from corral.server import serve as run_server
    from corral.server import serve_gateway

    if a.gateway:
        if not a.state:
            raise InvalidArgument("state", "a gateway needs a state store (--state)", None)
        from corral.control.burst import load_targets

        targets = load_targets(a.burst_targets) if a.burst_targets else []
        await serve_gateway(
            a.state,
            host=a.host,
            port=a.port,
            node_key=a.node_key,
            node_timeout=a.node_timeout,
            burst=[t.to_json() for t in targets],
            burst_threshold=a.burst_threshold,
            log_level=a.log_level,
        )
        return 0
    # A node a gateway places on takes tenants' creates: its registry pulls
    # are guarded (images/egress.py) unless CORRAL_PULL_GUARD says otherwise.
    guard = {"pull_guard": True} if a.state and "CORRAL_PULL_GUARD" not in os.environ else {}
    await run_server(
        NodeConfig.from_env(data_dir=a.data_dir, node=a.node, **guard),
        host=a.host,
        port=a.port,
        socket=a.socket,
        api_key=a.api_key,
        log_level=a.log_level,
        state=a.state,
        advertise=a.advertise,
    )
    return 0


async def gc(a: argparse.Namespace) -> int:
    from corral.node.agent import NodeAgent
    from corral.node.recovery import GcReport

    async with NodeAgent(node_config(a)) as agent:
        # Starting the agent already recovered the node if it became leader.
        report = GcReport()
        if agent.recovered:
            report.add(agent.recovered)
        again = await agent.recover()
        report.add(again)
        report.reattached = again.reattached
    emit(
        a,
        report.__dict__,
        f"reattached {report.reattached}, reclaimed "
        f"{report.reclaimed_sandboxes} sandboxes, resources {report.reclaimed or '{}'}, "
        f"released {report.layers_released} layer mounts",
    )
    return 0


def _guest_version() -> str | None:
    """The built guest artefacts' version (the install script builds them)."""
    from corral.runtimes.vm.guest import DEFAULT_OUT

    found = sorted(p.parent.name for p in DEFAULT_OUT.glob("*/ready"))
    return found[0] if found else None


async def doctor(a: argparse.Namespace) -> int:
    from corral.host import cgroups
    from corral.runtimes.container import bundle
    from corral.runtimes.vm.qemu import accelerator

    checks: dict[str, Any] = {
        "root": os.geteuid() == 0,
        "cgroups": cgroups.detect().value,
        "crun": shutil.which("crun"),
        "runc": shutil.which("runc"),
        "mkfs.erofs": shutil.which("mkfs.erofs"),
        "mkfs.btrfs": shutil.which("mkfs.btrfs"),
        "busybox": shutil.which("busybox"),
        "bash-static": shutil.which("bash-static"),
        "debootstrap": shutil.which("debootstrap"),
        "erofs": "erofs" in Path("/proc/filesystems").read_text(),
        "overlay": "overlay" in Path("/proc/filesystems").read_text(),
        "btrfs": "btrfs" in Path("/proc/filesystems").read_text(),
        "cap_sys_resource": bundle.CAN_PROTECT_INIT,
        "platform_helpers": (NodeConfig().platform_src / "bin" / "corral-init").exists(),
        "corral_run": (NodeConfig().platform_src / "bin" / "corral-run").exists(),
        # VMs: QEMU, the accelerator a guest would get, whether /dev/kvm is
        # there at all (present is not usable on nested PVM hosts), and the
        # guest artefacts' version if built.
        "qemu": shutil.which("qemu-system-x86_64"),
        "vm_accel": accelerator() if shutil.which("qemu-system-x86_64") else None,
        "dev_kvm": os.path.exists("/dev/kvm"),
        "guest": _guest_version(),
    }
    table = Table("CHECK", "RESULT")
    for k, v in checks.items():
        table.add_row(k, str(v))
    emit(a, checks, table)
    return 0


async def demo(a: argparse.Namespace) -> int:
    from corral.rollout.demo import run_demo, run_rl_demo

    if a.part == "rl":
        return await run_rl_demo(node_config(a), as_json=a.json)
    return await run_demo(node_config(a), sandboxes=a.sandboxes, as_json=a.json)


async def bench(a: argparse.Namespace) -> int:
    # The repository's bench/ folder: src/corral/cli/node.py is 3 levels in.
    bench_dir = Path(__file__).resolve().parents[3] / "bench"
    names = sorted(p.stem for p in bench_dir.glob("*.py") if not p.name.startswith("_"))
    if not a.name:
        print("benchmarks:", " ".join(names))
        return 0
    if a.name not in names:
        raise InvalidArgument("name", f"must be one of {', '.join(names)}", a.name)
    sys.argv = [str(bench_dir / f"{a.name}.py"), *a.args]
    await asyncio.to_thread(runpy.run_path, str(bench_dir / f"{a.name}.py"), run_name="__main__")
    return 0


async def blobd(a: argparse.Namespace) -> int:
    import uvicorn

    from corral.images.blobd import create_blob_app
    from corral.server import require_key_beyond_loopback

    require_key_beyond_loopback(a.host, a.api_key, "--api-key")
    rate = parse_size(a.rate, "rate") if a.rate else None
    app = create_blob_app(a.root, rate=rate, api_key=a.api_key)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=a.host, port=a.port, log_level="warning", access_log=False, lifespan="off"
        )
    )
    await server.serve()
    return 0
