"""One test per attack. Each asserts three things: the attack failed or was
contained; a neighbour sandbox with a steady workload was unaffected (its
exec latency within 2x of its baseline during the attack, none of its files
changed); and the audit recorded it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

import corral
from corral.config import NodeConfig

from ..framework.images import require_image
from . import attacks as a
from .attacks import Neighbour, Outcome
from .conftest import ATTACKER
from .standins import Standin, UpstreamDNS


async def check(neighbour: Neighbour, outcome: Outcome, ratio: float) -> None:
    assert outcome.contained, outcome.detail
    same, after, detail = await neighbour.unaffected()
    assert same, detail
    assert noticed(neighbour, ratio) is None, f"{noticed(neighbour, ratio)} during the attack"
    assert noticed(neighbour, after) is None, f"{noticed(neighbour, after)} after the attack"


# The neighbour's exec of `true` takes about 2 ms, so on 2 cores one
# scheduler slice given to the attacker's process doubles it. A neighbour
# "notices" when its median both doubles and grows by more than 5 ms.
NOTICE_RATIO = 2.0
NOTICE_ADDED_S = 0.005


def noticed(neighbour: Neighbour, ratio: float) -> str | None:
    added = (ratio - 1) * neighbour.baseline
    if ratio <= NOTICE_RATIO or added <= NOTICE_ADDED_S:
        return None
    return f"neighbour latency x{ratio:.2f} (+{added * 1000:.1f} ms)"


def host_alive() -> None:
    assert Path("/proc/self/stat").read_text()  # and this test process still runs
    assert subprocess.run(["true"]).returncode == 0


async def test_replaced_shell_changes_nothing_the_platform_runs(
    attacker: corral.AsyncSandbox, neighbour: Neighbour
) -> None:
    outcome, ratio = await a.during(neighbour, a.replace_platform_binaries(attacker))
    await check(neighbour, outcome, ratio)
    audit = await attacker.audit()
    assert audit.commands >= 2 and audit.log_bytes > 0


async def test_extent_swap_and_clone_ioctls_are_refused(
    attacker: corral.AsyncSandbox, neighbour: Neighbour
) -> None:
    outcome, ratio = await a.during(neighbour, a.extent_ioctls(attacker))
    await check(neighbour, outcome, ratio)
    audit = await attacker.audit()
    assert audit.syscalls_denied.get("extent-ioctl", 0) >= 6, audit.syscalls_denied


async def test_forged_requests_reach_nothing(
    attacker: corral.AsyncSandbox, neighbour: Neighbour
) -> None:
    outcome, ratio = await a.during(neighbour, a.forge_control_requests(attacker))
    await check(neighbour, outcome, ratio)
    assert (await attacker.audit()).syscalls.get("pidfd_getfd") == 1


async def test_sudo_is_not_had_by_a_user_the_image_does_not_name(
    rt_client: corral.AsyncClient, neighbour: Neighbour
) -> None:
    require_image("e2b-user:bookworm")
    sbx = await rt_client.sandboxes.create(**{**ATTACKER, "toolkit": ["e2b-user:bookworm"]})
    try:
        outcome, ratio = await a.during(neighbour, a.steal_sudo(sbx))
        await check(neighbour, outcome, ratio)
    finally:
        await sbx.close()


async def test_no_answers_or_platform_logs_inside(
    attacker: corral.AsyncSandbox, neighbour: Neighbour, rt_config: NodeConfig
) -> None:
    # The platform's own files about this sandbox: logs, bundle, and a
    # grader's answer key, all on the host side: in its sandbox dir (disk)
    # and in its bundle, around its rootfs (the run tmpfs).
    host_side = rt_config.sandboxes_dir / attacker.id
    (host_side / "grader-answer.txt").write_text("CORRAL-SECRET-ANSWER 42\n")
    (rt_config.bundles_dir / attacker.id / "grader-answer.txt").write_text(
        "CORRAL-SECRET-ANSWER 43\n"
    )
    await attacker.commands.run("echo CORRAL-SECRET-ANSWER-is-not-here-yet > /dev/null")
    outcome, ratio = await a.during(neighbour, a.read_for_answers(attacker))
    await check(neighbour, outcome, ratio)
    log = (host_side / "commands.log").read_text()
    assert "grep -rIl" in log  # the audit trail has the search


async def test_recursive_grep_from_root_finishes_and_the_host_stays_up(
    attacker: corral.AsyncSandbox, neighbour: Neighbour
) -> None:
    outcome, ratio = await a.during(neighbour, a.recursive_grep_from_root(attacker))
    await check(neighbour, outcome, ratio)
    host_alive()
    assert (await attacker.audit()).commands >= 1


async def test_kernel_knobs_are_read_only(
    attacker: corral.AsyncSandbox, neighbour: Neighbour
) -> None:
    outcome, ratio = await a.during(neighbour, a.write_kernel_knobs(attacker))
    await check(neighbour, outcome, ratio)
    host_alive()
    assert (await attacker.audit()).commands >= 1


async def test_privileged_syscalls_are_refused_and_counted(
    attacker: corral.AsyncSandbox, neighbour: Neighbour
) -> None:
    pid = int((await neighbour.sbx.commands.run("echo $$")).stdout)  # a pid in its namespace
    outcome, ratio = await a.during(neighbour, a.privileged_syscalls(attacker, pid))
    await check(neighbour, outcome, ratio)
    audit = await attacker.audit()
    for name in (
        "mount",
        "unshare",
        "setns",
        "ptrace",
        "keyctl",
        "bpf",
        "userfaultfd",
        "perf_event_open",
        "kexec_load",
        "open_by_handle_at",
        "init_module",
    ):
        assert audit.syscalls.get(name) == 1, (name, audit.syscalls)
    assert audit.syscalls_denied["privileged"] >= 11


async def test_runc_cve_classes(attacker: corral.AsyncSandbox, neighbour: Neighbour) -> None:
    outcome, ratio = await a.during(neighbour, a.runc_cve_classes(attacker))
    await check(neighbour, outcome, ratio)
    assert (await attacker.audit()).commands >= 1


async def test_fork_bomb_is_held_by_the_pids_limit(
    attacker: corral.AsyncSandbox, neighbour: Neighbour
) -> None:
    outcome, ratio = await a.during(neighbour, a.fork_bomb(attacker))
    await check(neighbour, outcome, ratio)
    audit = await attacker.audit()
    assert audit.pids_limit_hits > 0 and audit.commands_killed >= 1


async def test_memory_bomb_is_killed_inside(
    attacker: corral.AsyncSandbox, neighbour: Neighbour
) -> None:
    outcome, ratio = await a.during(neighbour, a.memory_bomb(attacker))
    await check(neighbour, outcome, ratio)
    assert (await attacker.audit()).oom_kills >= 1


async def test_disk_fill_stops_at_the_quota(
    attacker: corral.AsyncSandbox, neighbour: Neighbour
) -> None:
    outcome, ratio = await a.during(neighbour, a.disk_fill(attacker))
    await check(neighbour, outcome, ratio)
    audit = await attacker.audit()
    assert audit.disk_limit == 64 << 20
    assert audit.disk_used is not None and audit.disk_used >= 0.95 * audit.disk_limit, audit


async def test_inode_exhaustion_stops_at_the_quota(
    attacker: corral.AsyncSandbox, neighbour: Neighbour
) -> None:
    outcome, ratio = await a.during(neighbour, a.inode_exhaustion(attacker))
    await check(neighbour, outcome, ratio)
    audit = await attacker.audit()
    assert audit.disk_used is not None and audit.disk_used >= 0.9 * (64 << 20), audit


async def test_output_floods_cost_at_most_the_caps(
    attacker: corral.AsyncSandbox, neighbour: Neighbour, rt_config: NodeConfig
) -> None:
    outcome, ratio = await a.during(neighbour, a.output_flood(attacker))
    await check(neighbour, outcome, ratio)
    audit = await attacker.audit()
    assert audit.output_truncated >= 2 and audit.output_dropped_bytes >= 9_000_000_000
    assert audit.commands_timed_out >= 1
    log = rt_config.sandboxes_dir / attacker.id / "commands.log"
    assert log.stat().st_size < rt_config.log_quota


async def test_an_endless_printer_cannot_grow_the_platform_log(
    rt_client: corral.AsyncClient, neighbour: Neighbour, rt_config: NodeConfig
) -> None:
    sbx = await rt_client.sandboxes.create(image=a.IMAGE)

    async def spam() -> Outcome:
        for i in range(400):
            await sbx.commands.run(["echo", "x" * 3000, str(i)])
        return Outcome(True, "400 commands with 3 KB argv each")

    outcome, ratio = await a.during(neighbour, spam())
    await check(neighbour, outcome, ratio)
    log = rt_config.sandboxes_dir / sbx.id / "commands.log"
    assert log.stat().st_size <= rt_config.log_quota + 200
    audit = await sbx.audit()
    assert audit.log_quota_hits > 0 and audit.commands == 400


async def _networked(client: corral.AsyncClient, **extra: object) -> corral.AsyncSandbox:
    spec: dict[str, object] = {
        "image": a.IMAGE,
        "cpu": 0.5,
        "memory": "128MiB",
        "network": {"ecosystems": {"pypi": True}, "ports": [8080]},
    }
    return await client.sandboxes.create(**{**spec, **extra})  # type: ignore[arg-type]


async def test_port_scan_of_host_and_neighbours(
    rt_client: corral.AsyncClient, neighbour: Neighbour
) -> None:
    attacker = await _networked(rt_client)
    victim = await _networked(rt_client)
    await victim.commands.start("python3 -m http.server 8080")
    gateway = attacker.info.address.rsplit(".", 1)[0] + ".1"  # type: ignore[union-attr]
    targets = [victim.info.address, gateway, "192.0.2.2", "169.254.169.254", "10.0.0.1"]
    outcome, ratio = await a.during(neighbour, a.port_scan(attacker, targets))  # type: ignore[arg-type]
    await check(neighbour, outcome, ratio)
    assert (await attacker.audit()).egress_denied > 0


async def test_egress_to_a_denied_host_by_ip_and_by_name(
    rt_client: corral.AsyncClient, neighbour: Neighbour, standins: dict[str, Standin]
) -> None:
    attacker = await _networked(rt_client)
    assert (await a.fetch(attacker, "http://pypi.test:8080/answer.txt")).startswith("THE-REF")
    forbidden = standins["forbidden"]
    outcome, ratio = await a.during(
        neighbour,
        a.egress_to_denied(
            attacker, "http://answers.test:8080/answer.txt", f"{forbidden.url}/answer.txt"
        ),
    )
    await check(neighbour, outcome, ratio)
    audit = await attacker.audit()
    assert audit.egress_denied > 0 and audit.dns_denied > 0


@pytest.mark.requires_qemu
async def test_a_microvm_is_held_to_the_same_egress_policy(
    rt_client: corral.AsyncClient, standins: dict[str, Standin]
) -> None:
    """A VM's NIC is a tap bridged to the sandbox's veth: the host side, the
    resolver and the policy are a container's. It survives suspend/resume
    (same address), tightens at once, and a fork's copy comes up with an
    address of its own under the same policy."""
    index, forbidden = standins["index"], standins["forbidden"]
    vm = await _networked(
        rt_client, kind="microvm", memory="256MiB",
        network={"ecosystems": {"pypi": True}, "ports": [8080, 8081]},
    )  # fmt: skip
    try:
        assert vm.info.address is not None
        assert (await a.fetch(vm, "http://pypi.test:8080/answer.txt")).startswith("THE-REF")
        outcome = await a.egress_to_denied(
            vm, "http://answers.test:8080/answer.txt", f"{forbidden.url}/answer.txt"
        )
        assert outcome.contained, outcome.detail
        assert (await vm.audit()).egress_denied > 0
        await vm.suspend()
        await vm.resume()
        assert (await a.fetch(vm, "http://pypi.test:8080/answer.txt")).startswith("THE-REF")
        assert (await a.fetch(vm, f"{forbidden.url}/answer.txt")).startswith("blocked")
        await vm.files.write("/tmp/hold.py", a.HOLD)
        await vm.commands.run(
            f"nohup python3 /tmp/hold.py {index.ip} {index.echo_port} >/tmp/hold.log 2>&1 &"
        )
        assert await a.wait_file(vm, "/tmp/held") == "held"
        (copy,) = await rt_client.sandboxes.fork(vm, 1)
        try:
            # Its guest was told its own address after the load, and its
            # copy of the source's connection out was aborted.
            assert copy.info.address not in (None, vm.info.address)
            assert await a.own_address(copy) == copy.info.address
            await copy.files.write("/tmp/go", "")
            assert await a.wait_file(copy, "/tmp/result") == (
                "outside:ConnectionAbortedError loopback:x"
            )
            assert (await a.fetch(copy, "http://pypi.test:8080/answer.txt")).startswith("THE-REF")
            assert (await a.fetch(copy, f"{forbidden.url}/answer.txt")).startswith("blocked")
        finally:
            await copy.close()
        assert await a.own_address(vm) == vm.info.address
        await vm.files.write("/tmp/go", "")
        assert await a.wait_file(vm, "/tmp/result") == "outside:ping loopback:x"
        assert (await a.fetch(vm, "http://pypi.test:8080/answer.txt")).startswith("THE-REF")
        await vm.network.update({"cidrs": []})
        assert (await a.fetch(vm, "http://pypi.test:8080/answer.txt")).startswith("blocked")
    finally:
        await vm.close()
    quiet = await rt_client.sandboxes.create(kind="microvm", image=a.IMAGE, memory="256MiB")
    try:
        with pytest.raises(corral.InvalidArgument) as e:
            await quiet.network.update({"cidrs": ["10.0.0.0/8"]})
        assert e.value.field == "network"
        r = await quiet.commands.run(["python3", "-c", a.FETCH, f"{forbidden.url}/answer.txt"])
        assert r.stdout.startswith("blocked"), r.stdout  # no NIC at all
    finally:
        await quiet.close()


async def test_dns_tunnelling_through_the_resolver(
    rt_client: corral.AsyncClient, neighbour: Neighbour, upstream: UpstreamDNS
) -> None:
    attacker = await _networked(rt_client)
    before = len(upstream.asked)
    outcome, ratio = await a.during(neighbour, a.dns_tunnel(attacker))
    await check(neighbour, outcome, ratio)
    leaked = [n for n in upstream.asked[before:] if "attacker" in n]
    assert leaked == []
    assert (await attacker.audit()).dns_denied >= 8


async def test_package_install_allowed_while_setting_up_then_refused(
    rt_client: corral.AsyncClient, neighbour: Neighbour, pip_toolkit: str
) -> None:
    sbx = await _networked(rt_client, toolkit=pip_toolkit)
    pip = (
        "python3 -m pip install --break-system-packages --disable-pip-version-check "
        "--no-cache-dir --timeout 5 "
        "--retries 0 --trusted-host pypi.test --index-url http://pypi.test:8080/simple corral-canary"
    )

    async def install_then_tighten() -> Outcome:
        first = await sbx.commands.run(pip, timeout=120)
        value = await sbx.commands.run("python3 -c 'import corral_canary as c; print(c.VALUE)'")
        await sbx.network.update({"ecosystems": {"pypi": False}, "ports": [8080]})
        removed = await sbx.commands.run(
            "python3 -m pip uninstall -y --break-system-packages corral-canary", timeout=60
        )
        second = await sbx.commands.run(pip, timeout=120)
        ok = (
            first.exit_code == 0
            and "installed from the stand-in index" in value.stdout
            and second.exit_code != 0
        )
        return Outcome(
            ok,
            f"setup: exit {first.exit_code} {first.stderr[-400:]}; after "
            f"tightening: uninstall exit {removed.exit_code} {removed.stderr[-300:]}, "
            f"install exit {second.exit_code} {second.stdout[-300:]}",
        )

    outcome, ratio = await a.during(neighbour, install_then_tighten())
    await check(neighbour, outcome, ratio)
    assert (await sbx.audit()).dns_denied > 0
    info = await sbx.refresh()
    assert info.network is not None and info.network.ecosystems == {"pypi": False}
    json.dumps(info.model_dump(mode="json"))  # serialisable for the API


FNCALL_PROBE = r"""
import json, os, socket
out = {}
for name, path in (("kcore", "/proc/kcore"), ("sysrq", "/proc/sysrq-trigger")):
    try:
        open(path, "rb").read(16); out[name] = "read"
    except OSError as e:
        out[name] = e.errno
try:
    open("/proc/sys/kernel/panic", "w").write("1"); out["proc_sys"] = "wrote"
except OSError as e:
    out["proc_sys"] = e.errno
for host in ("169.254.169.254", "10.200.0.1", "1.1.1.1"):
    s = socket.socket(); s.settimeout(1)
    try:
        s.connect((host, 80)); out[host] = "connected"
    except OSError as e:
        out[host] = e.errno or "timeout"
print(json.dumps(out))
"""


async def test_function_calls_are_held_like_sandboxes(
    rt_client: corral.AsyncClient, neighbour: Neighbour
) -> None:
    async def attack() -> Outcome:
        priv = await rt_client.fncall.run("python", a.PRIV_SCRIPT)
        probe = await rt_client.fncall.run("python", FNCALL_PROBE)
        errnos = json.loads(priv.stdout)
        seen = json.loads(probe.stdout)
        ok = all(e == 1 for e in errnos.values()) and not any(
            v in ("read", "wrote", "connected") for v in seen.values()
        )
        return Outcome(ok, f"syscalls {errnos}; probes {seen}")

    outcome, ratio = await a.during(neighbour, attack())
    await check(neighbour, outcome, ratio)
    workers = await rt_client.sandboxes.list(labels={"corral.pool": "fncall"})
    denied = [await w.audit() for w in workers]
    assert sum(r.syscalls_denied.get("privileged", 0) for r in denied) >= 10
