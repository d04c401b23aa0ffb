"""The outside review's classes (issue 14, docs/guard.md): one test per
class, each with several variants, next to a neighbour that must not
notice, and each refusal counted in the audit by class."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import subprocess
import sys
from collections.abc import Awaitable
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

import corral
from corral.config import NodeConfig

from . import review_attacks as r
from .attacks import IMAGE, Neighbour, Outcome, during
from .test_attacks import check


async def test_32_bit_entry_is_refused_and_audited_as_its_64_bit_twin(
    attacker: corral.AsyncSandbox, neighbour: Neighbour
) -> None:
    before = await attacker.audit()
    outcome, ratio = await during(neighbour, r.int80_syscalls(attacker))
    await check(neighbour, outcome, ratio)
    audit = await attacker.audit()
    for name in r.PRIVILEGED_32:
        assert audit.syscalls.get(name, 0) >= 1, (name, audit.syscalls)
    assert audit.syscalls_denied.get("privileged", 0) >= len(r.PRIVILEGED_32)
    assert audit.syscalls_denied.get("socket-family", 0) >= 1
    # Nothing of it was filed under "other".
    assert audit.syscalls_denied.get("other", 0) == before.syscalls_denied.get("other", 0)


async def test_only_the_socket_families_a_sandbox_needs_are_allowed(
    attacker: corral.AsyncSandbox, neighbour: Neighbour
) -> None:
    outcome, ratio = await during(neighbour, r.socket_families(attacker))
    await check(neighbour, outcome, ratio)
    audit = await attacker.audit()
    assert audit.syscalls_denied.get("socket-family", 0) >= len(r.REFUSED_FAMILIES), audit


async def test_disk_beyond_the_pool_is_refused_by_admission(
    rt_client: corral.AsyncClient, rt_config: NodeConfig
) -> None:
    pool = rt_config.scratch_size
    for disk in ("4TiB", pool + 1, 64 * pool):
        with pytest.raises(corral.NodeFull) as exc:
            await rt_client.sandboxes.create(image=IMAGE, disk=disk)
        assert exc.value.details["reason"] == "disk" and "scratch pool" in exc.value.message
    # Nothing was made, and the pool still admits a sandbox of a fair size.
    assert not [s for s in await rt_client.sandboxes.list() if s.info.disk >= pool]
    ok = await rt_client.sandboxes.create(image=IMAGE, disk="64MiB")
    await ok.close()


async def test_disk_promised_is_bounded_by_pool_times_overcommit(
    rt_config: NodeConfig, data_root: Path
) -> None:
    small = replace(
        rt_config, data_dir=data_root / "disk", node="disk", scratch_size=1 << 30, disk_overcommit=2
    )
    async with corral.AsyncClient(config=small) as c:
        made = [await c.sandboxes.create(image=IMAGE, disk="768MiB") for _ in range(2)]
        with pytest.raises(corral.NodeFull, match="disk_overcommit 2"):
            await c.sandboxes.create(image=IMAGE, disk="768MiB")
        await made[0].close()  # released promises are admitted again
        made[0] = await c.sandboxes.create(image=IMAGE, disk="768MiB")
        for s in made:
            await s.close()


async def test_direct_io_is_throttled_per_sandbox(
    rt_client: corral.AsyncClient, neighbour: Neighbour, rt_config: NodeConfig
) -> None:
    streamer = await rt_client.sandboxes.create(image=IMAGE, disk="1GiB", labels={"role": "io"})
    outcome, ratio = await during(neighbour, r.direct_io_stream(streamer, mib=512))
    await check(neighbour, outcome, ratio)
    write, read = outcome.extra["rates"]
    # Long enough that the throttle's first slice of burst does not count.
    assert write <= rt_config.disk_write_bps * 1.1, outcome.detail
    assert read <= rt_config.disk_read_bps * 1.1, outcome.detail
    await streamer.close()


async def test_a_resolver_flood_costs_the_neighbour_nothing(
    rt_client: corral.AsyncClient, neighbour: Neighbour
) -> None:
    flooder = await rt_client.sandboxes.create(
        image=IMAGE, network={"domains": ["allowed.test"]}, labels={"role": "dns"}
    )
    try:
        outcome, ratio = await during(neighbour, r.dns_flood(flooder, seconds=6))
        await check(neighbour, outcome, ratio)
        audit = await flooder.audit()
        # Past the rate, queries were dropped in the kernel, not parsed.
        assert audit.dns_flooded > 0 and audit.dns_denied > 0, audit
        assert audit.dns_flooded + audit.dns_denied <= outcome.extra["sent"]
        # The resolver still answers the flooder's allowed names afterwards.
        answer = await flooder.commands.run(
            "python3 -c \"import socket; socket.getaddrinfo('allowed.test', 80)\"", timeout=30
        )
        assert "refused" not in answer.stderr.lower(), answer.stderr
    finally:
        await flooder.close()


async def test_setuid_files_committed_are_inert_on_the_host(
    rt_client: corral.AsyncClient, rt_config: NodeConfig, tmp_path: Path
) -> None:
    """Class 2: a setuid-root file made in a sandbox and committed is, on
    the host, under a mount that is nosuid and nodev, inside a directory
    no other host user can enter. In a sandbox the layer keeps its bits as
    given, and no_new_privs (every sandbox process has it) keeps them from
    raising anyone: stricter than an image may expect (docs/guard.md)."""
    src = await rt_client.sandboxes.create(image=IMAGE)
    made = await src.commands.run(r.SETUID)
    assert made.stdout.strip() == "4755 root", made
    layer = await src.commit("redteam-suid:1", kind="toolkit")
    await src.close()
    user = await rt_client.sandboxes.create(image=IMAGE, toolkit="redteam-suid:1")
    try:
        bits = await user.commands.run("stat -c '%a %U' /usr/local/bin/corral-suid-id")
        assert bits.stdout.strip() == "4755 root", bits  # kept as the image gave them
        inside = await user.commands.run("corral-suid-id -u", user="nobody")
        assert inside.stdout.strip() == "65534", inside  # no_new_privs: not raised
        # On the host: the layer's mount is nosuid,nodev, under a 0700 tree.
        options = {
            mount.split()[4]: mount.split()[5]
            for mount in Path("/proc/self/mountinfo").read_text().splitlines()
            if layer.digest.removeprefix("sha256:")[:16] in mount.split()[4]
        }
        assert options and all(
            {"nosuid", "nodev", "ro"} <= set(o.split(",")) for o in options.values()
        )
        # The data dir may be traversed (a sandbox's own root walks it to its
        # rootfs), never listed; the layer mounts below it are root's alone.
        assert rt_config.data_dir.stat().st_mode & 0o066 == 0
        assert rt_config.mounts_dir.stat().st_mode & 0o077 == 0
        probe = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "ls", str(rt_config.mounts_dir)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert probe.returncode != 0 and "Permission denied" in probe.stderr, probe
        # Even reached (as root), it runs without the privilege it claims.
        target = next(iter(options)) + "/usr/local/bin/corral-suid-id"
        run = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", target, "-u"],
            capture_output=True, text=True,
        )  # fmt: skip
        assert run.returncode != 0 or run.stdout.strip() != "0", run
    finally:
        await user.close()


# ----------------------------------------------------------------- class 9


async def test_an_unkeyed_server_listens_on_loopback_only(tmp_path: Path) -> None:
    for host in ("0.0.0.0", "10.0.0.1", "::", "example.org"):
        out = subprocess.run(
            [sys.executable, "-m", "corral.cli.main", "--data-dir", str(tmp_path / "n"),
             "serve", "--host", host, "--port", "1"],
            capture_output=True, text=True, timeout=60,
            env={k: v for k, v in os.environ.items() if k != "CORRAL_API_KEY"},
        )  # fmt: skip
        assert out.returncode == 2 and "API key" in out.stderr and "host" in out.stderr, out
    assert not (tmp_path / "n" / "state.db").exists()  # refused before anything started


async def test_metrics_and_the_blob_store_need_the_key(tmp_path: Path) -> None:
    from fastapi import FastAPI

    from corral.api.app import create_app
    from corral.api.http import HttpService
    from corral.images.blobd import create_blob_app

    root = tmp_path / "blobs"
    (root / "blobs" / "sha256").mkdir(parents=True)
    (root / "blobs" / "sha256" / "ab").write_bytes(b"layer")
    # Any service will do: these routes never reach it.
    app: FastAPI = create_app(HttpService("http://127.0.0.1:9"), api_key="k")
    create_blob_app(root, api_key="k", app=app, prefix="/blobs")
    good = {"authorization": "Bearer k"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
        for method, url in (("GET", "/metrics"), ("GET", "/blobs/objects/blobs/sha256/ab"),
                            ("HEAD", "/blobs/objects/blobs/sha256/ab"), ("GET", "/blobs/objects"),
                            ("GET", "/blobs/stats"), ("PUT", "/blobs/objects/x")):  # fmt: skip
            for headers in ({}, {"authorization": "Bearer wrong"}):
                resp = await h.request(method, url, headers=headers, content=b"x")
                assert resp.status_code == 401, (method, url, headers)
        assert (await h.get("/metrics", headers=good)).status_code == 200
        assert (await h.get("/blobs/objects/blobs/sha256/ab", headers=good)).content == b"layer"
        # A listing's prefix is an object name, never a host path.
        for prefix in ("..", "../..", "/etc", "blobs/../..", "./", "a\\..\\b"):
            resp = await h.get("/blobs/objects", params={"prefix": prefix}, headers=good)
            assert resp.status_code == 400, prefix
        listed = await h.get("/blobs/objects", params={"prefix": "blobs"}, headers=good)
        assert listed.json() == {"keys": ["blobs/sha256/ab"]}
        assert not (root / "x").exists()


async def test_a_body_over_the_cap_is_refused_before_it_is_read() -> None:
    from corral.api.app import create_app
    from corral.api.http import HttpService
    from corral.api.routes import MAX_BODY

    app = create_app(HttpService("http://127.0.0.1:9"))  # never reached
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as h:
        resp = await h.put(
            "/v1/sandboxes/t-0123456789abcdef/files",
            params={"path": "/x"},
            headers={"content-length": str(MAX_BODY + 1)},
            content=b"",
        )
    assert resp.status_code == 400 and resp.json()["error"]["field"] == "body"


# ----------------------------------------------------------------- class 8


@pytest.mark.requires_qemu
async def test_a_guest_flooding_its_console_is_held_to_the_cap(
    rt_client: corral.AsyncClient, rt_config: NodeConfig, neighbour: Neighbour
) -> None:
    """Guest root writes its serial console as fast as it can: the host's
    copy (outside any quota of the sandbox's) stays under its cap, what
    was trimmed is audited, and the neighbour does not notice."""
    from corral.runtimes.vm.runtime import CONSOLE_KEEP, CONSOLE_MAX

    vm = await rt_client.sandboxes.create(kind="microvm", image=IMAGE, memory="256MiB", cpu=0.5)
    log = rt_config.sandboxes_dir / vm.id / "console.log"
    try:
        flood = vm.commands.run(
            "head -c 6000000 /dev/zero | tr '\\0' x > /dev/ttyS0; echo done", timeout=300
        )
        outcome, ratio = await during(neighbour, _as_outcome(flood))
        await check(neighbour, outcome, ratio)
        await asyncio.sleep(rt_config.liveness_interval * 2 + 1)  # a trim tick after the end
        assert log.stat().st_size <= CONSOLE_MAX + CONSOLE_KEEP, log.stat().st_size
        audit = await vm.audit()
        assert audit.console_dropped_bytes > 0, audit
        # The guest still answers, and its last console lines are still there.
        assert (await vm.commands.run("echo alive")).stdout == "alive\n"
        assert log.read_bytes().endswith(b"x")
    finally:
        await vm.close()


async def _as_outcome(run: Awaitable[corral.CommandResult]) -> Outcome:
    r = await run
    return Outcome(r.stdout.strip() == "done", f"exit {r.exit_code} {r.stderr[-200:]}")


# ----------------------------------------------------------------- class 3


async def test_a_sandbox_at_its_kernel_counter_limits_leaves_the_neighbour_its_own(
    rt_client: corral.AsyncClient, rt_config: NodeConfig
) -> None:
    """inotify instances and watches are the sandbox's own share (per user
    namespace), AIO events a per-sandbox budget, POSIX message queues
    refused: a sandbox holding all it can get leaves a neighbour able to
    use each, and the host root too."""
    hog = await rt_client.sandboxes.create(image=IMAGE, pids=256, disk="512MiB")
    other = await rt_client.sandboxes.create(image=IMAGE, pids=256, disk="512MiB")
    try:
        holding = hog.commands.start(
            ["python3", "-c", r.COUNTERS.replace("print(", "import time; print(") + "\ntime.sleep(30)",
             str(rt_config.aio_events // 2), str(rt_config.aio_events // 2), "4096"],
        )  # fmt: skip
        handle = await holding
        await asyncio.sleep(3)  # the hog holds everything it could take
        theirs = await r.kernel_counters(other, 4096)
        assert theirs["instances"] == rt_config.inotify_instances, theirs
        assert theirs["watches"] == rt_config.inotify_watches, theirs
        assert theirs["mq"] == 1 and theirs["aio"] == [0], theirs  # EPERM; granted
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.inotify_init1(0)  # the host root still can
        assert fd >= 0, ctypes.get_errno()
        os.close(fd)
        hogged = await handle.wait()
        mine = json.loads(hogged.stdout)
        assert mine["instances"] == rt_config.inotify_instances, mine
        assert mine["aio"] == [0, 0, 11], mine  # the third is past the budget: EAGAIN
        audit = await hog.audit()
        assert audit.syscalls.get("io_setup") == 1 and audit.syscalls.get("mq_open") == 1, audit
        assert audit.syscalls_denied.get("kernel-quota") == 2, audit
    finally:
        await asyncio.gather(hog.close(), other.close())


# ----------------------------------------------------------------- class 7


async def test_links_an_agent_plants_do_not_redirect_the_trainers_files(
    rt_client: corral.AsyncClient,
) -> None:
    """An agent running as an unprivileged user plants links; the trainer's
    file operations with follow_symlinks=False refuse every link in the
    path (final or inner, to a file or to a directory), read and write, and
    root's files stay as they were."""
    sbx = await rt_client.sandboxes.create(image=IMAGE)
    try:
        before = await sbx.files.read("/etc/passwd")
        planted = await sbx.commands.run(
            "mkdir -p /tmp/w && ln -s /etc/passwd /tmp/w/out && ln -s /etc /tmp/w/dir "
            "&& ln -s /etc/shadow /tmp/w/secret && echo planted",
            user="nobody",
        )
        assert planted.stdout == "planted\n", planted
        for path in ("/tmp/w/out", "/tmp/w/dir/passwd", "/tmp/w/dir/new/file"):
            with pytest.raises(corral.FileError) as exc:
                await sbx.files.write(path, b"owned\n", user="root", follow_symlinks=False)
            assert exc.value.details["errno"] == 40, (path, exc.value)  # ELOOP
            with pytest.raises(corral.FileError):
                await sbx.files.read(path.replace("/new/file", "/passwd"),
                                     user="root", follow_symlinks=False)  # fmt: skip
        with pytest.raises(corral.FileError):
            await sbx.files.read("/tmp/w/secret", user="root", follow_symlinks=False)
        assert await sbx.files.read("/etc/passwd") == before
        assert not await sbx.files.exists("/etc/new")  # no directory made through the link
        # Without links, the same calls work; following links stays the default.
        assert await sbx.files.write("/tmp/w/plain", b"ok", follow_symlinks=False) == 2
        assert await sbx.files.read("/tmp/w/plain", follow_symlinks=False) == b"ok"
        assert await sbx.files.read("/tmp/w/out") == before
    finally:
        await sbx.close()


async def test_file_operations_run_as_the_sandboxs_default_user(
    rt_client: corral.AsyncClient, rt_config: NodeConfig, tmp_path: Path
) -> None:
    """In an image whose default user is unprivileged, a trainer's files
    calls run as that user unless they name another: the platform cannot be
    made to write what the sandbox's own user could not."""
    from corral.images.build import build_from_dir
    from corral.images.layer import ImageConfig
    from corral.images.store import ImageStore

    (tmp_path / "tk" / "etc").mkdir(parents=True)
    build_from_dir(
        ImageStore(rt_config.images_dir), tmp_path / "tk", tag="redteam-user:1",
        kind="toolkit", config=ImageConfig(user="nobody"),
    )  # fmt: skip
    sbx = await rt_client.sandboxes.create(image=IMAGE, toolkit="redteam-user:1")
    try:
        with pytest.raises(corral.FileError) as exc:
            await sbx.files.write("/etc/corral-owned", b"x")
        assert exc.value.details["errno"] == 13, exc.value  # EACCES: nobody may not
        await sbx.files.write("/tmp/mine", b"x")
        owner = await sbx.commands.run("stat -c %U /tmp/mine")
        assert owner.stdout.strip() == "nobody", owner
        with pytest.raises(corral.FileError):
            await sbx.files.read("/etc/shadow")
        assert await sbx.files.write("/etc/corral-root", b"x", user="root") == 1  # named: root
    finally:
        await sbx.close()


# ----------------------------------------------------------------- class 1


@pytest.mark.requires_qemu
async def test_saves_and_restores_reach_only_the_operators_stores(
    rt_client: corral.AsyncClient, rt_config: NodeConfig, tmp_path: Path
) -> None:
    """A caller cannot make the node write a VM's state into a host path,
    fetch one from a URL of its choosing (with the node's keys), or restore
    another project's state."""
    vm = await rt_client.sandboxes.create(kind="microvm", image=IMAGE, memory="256MiB")
    try:
        target = tmp_path / "planted"
        for store in (str(target), f"file://{target}", "http://169.254.169.254/latest",
                      "s3://attacker/x", "../../etc", "nope"):  # fmt: skip
            with pytest.raises(corral.InvalidArgument) as exc:
                await vm.save(store)
            assert exc.value.field == "store", store
        assert not target.exists() and (await vm.refresh()).state.value == "running"
        saved = await vm.save()
        for change, field in (({"store": "http://127.0.0.1:9/x"}, "store"),
                              ({"store": "/var/lib"}, "store"),
                              ({"project": "someone-else"}, "key"),
                              ({"cpu": 0.1}, "cpu")):  # fmt: skip
            with pytest.raises(corral.InvalidArgument) as exc:
                await rt_client.sandboxes.restore({**saved.model_dump(), **change})
            assert exc.value.field == field, change
        assert len([s for s in await rt_client.sandboxes.list() if s.info.kind == "microvm"]) == 1
    finally:
        await vm.close()


# Threads that watch their own fd table for a seccomp listener, to answer
# their own refused calls with CONTINUE: a restore gives each task a new
# listener, which lands in the task's fd table before the node takes it.
LISTENER_HUNT = r"""
import os, threading, time
def hunt():
    while True:
        for fd in os.listdir("/proc/self/fd"):
            try:
                if "seccomp" in os.readlink(f"/proc/self/fd/{fd}"):
                    os.dup(int(fd))
                    open("/tmp/caught", "a").write(fd + "\n")
            except OSError:
                pass
for _ in range(3):
    threading.Thread(target=hunt, daemon=True).start()
open("/tmp/hunting", "w").write("yes")
while True:
    time.sleep(1)
"""


UNSHARE = "import ctypes; c = ctypes.CDLL(None, use_errno=True); print(c.unshare(0x20000), ctypes.get_errno())"


async def test_a_restored_sandbox_never_sees_its_new_seccomp_listener(
    rt_client: corral.AsyncClient,
) -> None:
    sbx = await rt_client.sandboxes.create(image=IMAGE, memory="128MiB")
    try:
        await sbx.files.write("/tmp/hunt.py", LISTENER_HUNT)
        await sbx.commands.run("nohup python3 /tmp/hunt.py >/dev/null 2>&1 &")
        for _ in range(50):
            if await sbx.files.exists("/tmp/hunting"):
                break
            await asyncio.sleep(0.1)
        for _ in range(3):  # each restore hands out a listener per task
            await sbx.suspend("disk")
            r = await sbx.commands.run(f"cat /tmp/caught 2>/dev/null; python3 -c '{UNSHARE}'")
            assert r.stdout == "-1 1\n", r.stdout  # refused by the guard (EPERM), none caught
        assert not await sbx.files.exists("/tmp/caught")
        assert (await sbx.audit()).syscalls.get("unshare", 0) >= 3
    finally:
        await sbx.close()


@pytest.mark.parametrize("runtime", ["crun", "corral"])
async def test_the_host_device_nodes_a_sandbox_is_given_stay_the_hosts(
    node_config: NodeConfig, data_root: Path, runtime: str
) -> None:
    """The host's /dev/null, /dev/zero, ... are bound into every container.
    crun 1.8 fchowns a container's stdio to its root before it reopens
    stdin inside: given the host's /dev/null as stdin, it made the host's
    /dev/null the first id block's, and a sandbox of that block could
    chmod it for the whole host (host/devices.py). Whichever runtime, the
    host's nodes stay root's, and a sandbox's chmod or chown of them is
    refused."""
    from corral.host import devices

    before = {d: os.stat(f"/dev/{d}") for d in devices.BOUND}
    assert all(st.st_uid == 0 and st.st_gid == 0 for st in before.values()), before
    cfg = replace(node_config, data_dir=data_root / f"dev-{runtime}", node=f"dv{runtime[:3]}",
                  oci_runtime=runtime)  # fmt: skip
    async with corral.AsyncClient(config=cfg) as c:
        s = await c.sandboxes.create(image=IMAGE)
        try:
            r = await s.commands.run(
                "for d in null zero full tty random urandom; do "
                "chmod 0600 /dev/$d 2>/dev/null && echo chmod $d; "
                "chown 0:0 /dev/$d 2>/dev/null && echo chown $d; done; true"
            )
        finally:
            await s.close()
    assert r.stdout == ""
    for d, st in before.items():
        now = os.stat(f"/dev/{d}")
        assert (now.st_uid, now.st_gid, now.st_mode) == (0, 0, st.st_mode), d


async def test_a_node_starting_gives_back_a_device_node_an_older_corral_gave_away(
    node_config: NodeConfig, data_root: Path
) -> None:
    """What crun 1.8 did before corral-nsexec stopped handing it the host's
    /dev/null (the test above) is undone when a node starts: the owner and
    the mode its sandbox may have set."""
    from corral.node.admission import ID_BASE

    os.chown("/dev/zero", ID_BASE, ID_BASE)
    os.chmod("/dev/zero", 0o600)
    try:
        cfg = replace(node_config, data_dir=data_root / "dev-repair", node="dvrep")
        async with corral.AsyncClient(config=cfg) as c:
            await c.sandboxes.list()
        st = os.stat("/dev/zero")
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, 0o666)
    finally:
        os.chown("/dev/zero", 0, 0)
        os.chmod("/dev/zero", 0o666)
