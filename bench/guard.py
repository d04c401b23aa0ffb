"""The guard, measured: every attack of the red-team suite with its outcome
and the neighbour's latency during it, and what the defences cost.

    corral bench guard

Runs the attacks of tests/redteam/attacks.py against a real node with
stand-in hosts (the same set-up as the suite), one fresh attacker each,
next to one neighbour with a steady workload. Then create and exec latency
with the defences on and off: seccomp (allow-list with notifications),
and the per-sandbox network (netns + veth + nftables + DNS).
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from tests.redteam import attacks as a  # noqa: E402
from tests.redteam import review_attacks as r  # noqa: E402
from tests.redteam.standins import UpstreamDNS, standin_hosts  # noqa: E402

import corral  # noqa: E402
from _common import IMAGES, pct, table, write_result  # noqa: E402
from corral.config import NodeConfig  # noqa: E402

WORK = Path("/var/lib/corral-guard")
NET = {"ecosystems": {"pypi": True}, "ports": [8080]}


async def attacker(c: corral.AsyncClient, network: bool = False) -> corral.AsyncSandbox:
    return await c.sandboxes.create(
        image=a.IMAGE,
        cpu=0.5,
        memory="128MiB",
        pids=64,
        disk="64MiB",
        network=NET if network else None,
    )


async def run_attacks(c: corral.AsyncClient, forbidden_url: str) -> list[list[str]]:
    n = await a.Neighbour.start(c)
    rows = []

    async def one(name: str, make: Callable[[], Awaitable[a.Outcome]]) -> None:
        t0 = time.perf_counter()
        outcome, ratio = await a.during(n, make())
        same, after, _ = await n.unaffected()
        rows.append(
            [
                name,
                "contained" if outcome.contained else "**NOT CONTAINED**",
                f"{max(ratio, after):.2f}",
                "unchanged" if same else "**CHANGED**",
                f"{time.perf_counter() - t0:.0f}",
                outcome.detail.replace("|", "/")[:160],
            ]
        )
        print(rows[-1], flush=True)

    pid = int((await n.sbx.commands.run("echo $$")).stdout)
    plain = [
        ("replace /bin/bash and friends", a.replace_platform_binaries),
        ("extent swap / clone ioctls", a.extent_ioctls),
        ("forged requests to every socket and fd", a.forge_control_requests),
        ("read for answers and platform logs", a.read_for_answers),
        ("grep -r from /", a.recursive_grep_from_root),
        ("write /proc/sys, sysrq, core_pattern", a.write_kernel_knobs),
        ("runc CVE classes (/proc/self/exe, leaked fds)", a.runc_cve_classes),
        ("fork bomb", a.fork_bomb),
        ("memory bomb", a.memory_bomb),
        ("disk fill", a.disk_fill),
        ("inode exhaustion", a.inode_exhaustion),
        ("`yes` flood and a 10 GB stdout", a.output_flood),
    ]
    for name, fn in plain:
        sbx = await attacker(c)
        await one(name, partial(fn, sbx))
        await sbx.close()
    sbx = await attacker(c)
    await one(
        "privileged syscalls (mount, unshare, setns, ptrace, bpf, ...)",
        lambda: a.privileged_syscalls(sbx, pid),
    )
    await sbx.close()
    sbx, victim = await attacker(c, True), await attacker(c, True)
    await victim.commands.start("python3 -m http.server 8080")
    gw = str(sbx.info.address).rsplit(".", 1)[0] + ".1"
    await one(
        "port scan of host and neighbours",
        lambda: a.port_scan(sbx, [str(victim.info.address), gw, "192.0.2.2", "169.254.169.254"]),
    )
    await one(
        "egress to a denied host, by IP and by name",
        lambda: a.egress_to_denied(sbx, "http://answers.test:8080/answer.txt", forbidden_url),
    )
    await one("DNS tunnelling through the resolver", lambda: a.dns_tunnel(sbx))
    for s in (sbx, victim):
        await s.close()
    await review_attacks(c, one)
    await n.stop()
    return rows


async def review_attacks(
    c: corral.AsyncClient, one: Callable[[str, Callable[[], Awaitable[a.Outcome]]], Awaitable[None]]
) -> None:
    """The second round's classes (issue 14), each next to the neighbour."""
    sbx = await attacker(c)
    await one("privileged syscalls through int 0x80", lambda: r.int80_syscalls(sbx))
    await one("sockets of other families (vsock, packet, netlink audit, ...)",
              lambda: r.socket_families(sbx))  # fmt: skip

    async def counters() -> a.Outcome:
        got = await r.kernel_counters(sbx, 40000, 40000)
        ok = got.get("instances") == 128 and got.get("mq") == 1 and got.get("aio") == [0, 11]
        return a.Outcome(ok, f"took {got}")

    await one("host-wide kernel counters (inotify, AIO, mqueue)", counters)
    await sbx.close()
    io = await c.sandboxes.create(image=a.IMAGE, disk="1GiB")
    await one("O_DIRECT stream to the scratch pool", lambda: _throttled(io))
    await io.close()
    dns = await c.sandboxes.create(image=a.IMAGE, network={"domains": ["allowed.test"]})
    await one("DNS flood of refused names", lambda: r.dns_flood(dns, 6))
    await dns.close()
    if shutil.which("qemu-system-x86_64"):
        vm = await c.sandboxes.create(kind="microvm", image=a.IMAGE, memory="256MiB")
        await one("a VM guest flooding its console", lambda: _console(vm))
        await vm.close()


async def _throttled(sbx: corral.AsyncSandbox) -> a.Outcome:
    out = await r.direct_io_stream(sbx, mib=512)
    rates = out.extra.get("rates", [])
    ok = len(rates) == 2 and max(rates) <= 1.1 * 128 * 2**20
    return a.Outcome(ok, "MB/s " + ", ".join(f"{x / 1e6:.0f}" for x in rates))


async def _console(vm: corral.AsyncSandbox) -> a.Outcome:
    res = await vm.commands.run(
        "head -c 6000000 /dev/zero | tr '\\0' x > /dev/ttyS0; echo done", timeout=300
    )
    await asyncio.sleep(12)  # a liveness tick trims it
    audit = await vm.audit()
    ok = res.stdout.strip() == "done" and audit.console_dropped_bytes > 0
    return a.Outcome(ok, f"trimmed {audit.console_dropped_bytes} bytes of console")


async def costs(cfg: NodeConfig) -> list[list[str]]:
    rows = []
    variants = [
        ("all defences (seccomp, user namespace, no network)", cfg, None),
        ("seccomp off", replace(cfg, seccomp=False), None),
        ("user namespace off", replace(cfg, userns=False), None),
        ("seccomp and user namespace off", replace(cfg, seccomp=False, userns=False), None),
        ("seccomp + network policy (netns, veth, nftables, DNS)", cfg, NET),
        ("per-namespace counter shares off (inotify)",
         replace(cfg, inotify_instances=0, inotify_watches=0), None),
        ("block I/O ceilings off", replace(cfg, disk_read_bps=0, disk_write_bps=0), None),
    ]  # fmt: skip
    for name, config, net in variants:
        async with corral.AsyncClient(config=config) as c:
            creates, execs = [], []
            for _ in range(30):
                t0 = time.perf_counter()
                s = await c.sandboxes.create(image=a.IMAGE, network=net)
                creates.append(time.perf_counter() - t0)
                for _ in range(40):
                    t0 = time.perf_counter()
                    await s.commands.run(["true"])
                    execs.append(time.perf_counter() - t0)
                await s.close()
            py = []
            s = await c.sandboxes.create(image=a.IMAGE, network=net)
            for _ in range(10):
                t0 = time.perf_counter()
                await s.commands.run(["python3", "-c", "import json, os; os.listdir('/')"])
                py.append(time.perf_counter() - t0)
            await s.close()
        rows.append(
            [
                name,
                f"{statistics.median(creates) * 1000:.1f}",
                f"{pct(creates, 99) * 1000:.1f}",
                f"{statistics.median(execs) * 1000:.2f}",
                f"{pct(execs, 99) * 1000:.2f}",
                f"{statistics.median(py) * 1000:.1f}",
            ]
        )
        print(rows[-1], flush=True)
    return rows


async def main() -> None:
    shutil.rmtree(WORK, ignore_errors=True)
    WORK.mkdir(parents=True)
    upstream = UpstreamDNS()
    with standin_hosts(WORK) as hosts:
        cfg = NodeConfig.from_env(
            data_dir=WORK / "node",
            images=IMAGES,
            node="guard",
            network_pool="10.202.0.0/16",
            dns_port=10253,
            dns_upstream=f"127.0.0.1:{upstream.port}",
            dns_hosts={"pypi.test": hosts["index"].ip, "answers.test": hosts["forbidden"].ip},
            ecosystems={"pypi": ["pypi.test"]},
            log_quota=64 * 1024,
        )
        async with corral.AsyncClient(config=cfg) as c:
            rows = await run_attacks(c, f"{hosts['forbidden'].url}/answer.txt")
        cost = await costs(cfg)
    upstream.close()
    sections = [
        "## Attacks\n\nEach attack in a fresh sandbox (0.5 CPU, 128 MiB, 64 pids, 64 MiB "
        "disk) next to a neighbour sandbox running a steady workload; the ratio is the "
        "neighbour's median exec latency of `true` during (or right after) the attack over "
        "its baseline; its files are checksummed before and after.\n\n"
        + table(
            [
                "attack",
                "outcome",
                "neighbour latency ratio",
                "neighbour files",
                "seconds",
                "what the attacker saw",
            ],
            rows,
        ),
        "## What the defences cost\n\nMedians over 30 creates and 1,200 execs per row, same "
        "machine, same run. The ratios are the row's p50 over the first row's (every "
        "defence on): a row with a defence off below 1.00 is what that defence costs.\n\n"
        + table(
            [
                "configuration",
                "create p50 (ms)",
                "create p99 (ms)",
                "exec `true` p50 (ms)",
                "exec p99 (ms)",
                "python3 start (ms)",
                "create vs all on",
                "exec vs all on",
            ],
            [
                [
                    *row,
                    f"{float(row[1]) / float(cost[0][1]):.2f}",
                    f"{float(row[3]) / float(cost[0][3]):.2f}",
                ]
                for row in cost
            ],
        ),
    ]
    print(
        write_result(
            "guard", "Guard: attacks contained, and the cost of the defences", sections
        ).read_text()
    )
    shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
