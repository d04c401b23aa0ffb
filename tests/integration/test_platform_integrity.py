"""The platform never trusts the sandbox's files, and its control channel
cannot be reached or disturbed from inside. (The full adversarial suite is
tests/redteam; these are the foundation's own guarantees.)"""

from __future__ import annotations

import asyncio
import json

import corral
from corral.config import NodeConfig

from ..framework import IMAGE


async def test_replacing_the_images_shells_changes_nothing_we_run(
    client: corral.AsyncClient,
) -> None:
    sbx = await client.sandboxes.create(image=IMAGE)
    evil = "#!/bin/sh.real\necho INJECTED\n"
    r = await sbx.commands.run(
        "cp /bin/sh /bin/sh.real; for f in /bin/sh /bin/bash /bin/dash /usr/bin/env; do "
        f"printf '{evil}' > $f; chmod 755 $f; done; echo replaced"
    )
    assert r.stdout == "replaced\n"
    r = await sbx.commands.run("echo clean")
    assert r.stdout == "clean\n"  # the platform's shell comes from /.corral
    data = await sbx.files.read("/bin/bash")
    assert b"INJECTED" in data  # the agent only fooled itself
    tar = await sbx.files.download_tar("/etc")
    assert len(tar) > 10_000


async def test_the_platform_layer_is_read_only(client: corral.AsyncClient) -> None:
    sbx = await client.sandboxes.create(image=IMAGE)
    r = await sbx.commands.run(
        "echo x > /.corral/bin/sh; rm -f /.corral/bin/corral-init; "
        "mount -o remount,rw /.corral; ls /.corral/bin"
    )
    assert "corral-init" in r.stdout
    assert r.stderr.count("Read-only file system") == 2
    assert "mount" in r.stderr  # no CAP_SYS_ADMIN to remount


async def test_control_channel_is_out_of_reach(client: corral.AsyncClient) -> None:
    sbx = await client.sandboxes.create(image=IMAGE)
    script = (
        "import ctypes, os, socket, stat\n"
        "found = []\n"
        "for root, dirs, files in os.walk('/', topdown=True):\n"
        "    dirs[:] = [d for d in dirs if not (root == '/' and d in ('proc', 'sys'))]\n"
        "    for f in files:\n"
        "        try:\n"
        "            if stat.S_ISSOCK(os.lstat(os.path.join(root, f)).st_mode):\n"
        "                found.append(os.path.join(root, f))\n"
        "        except OSError: pass\n"
        "print('sockets', found)\n"
        "for fd in os.listdir('/proc/1/fd'):\n"
        "    try: os.readlink('/proc/1/fd/' + fd); print('readlink ok', fd)\n"
        "    except OSError as e: print('readlink', e.errno)\n"
        "    s = socket.socket(socket.AF_UNIX)\n"
        "    try: s.connect('/proc/1/fd/' + fd); print('connect ok', fd)\n"
        "    except OSError as e: print('connect', e.errno)\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "pidfd = libc.syscall(434, 1, 0)\n"
        "got = libc.syscall(438, pidfd, 3, 0)\n"
        "print('pidfd_getfd', got, ctypes.get_errno())\n"
        "for p in ('/proc/1/environ', '/proc/1/mem', '/proc/1/root/'):\n"
        "    try: open(p, 'rb').read(1); print('open ok', p)\n"
        "    except OSError as e: print('open', p, e.errno)\n"
    )
    r = await sbx.commands.run(["python3", "-c", script], timeout=60)
    out = r.stdout
    assert "sockets []" in out, out
    assert "ok" not in out, out  # no readlink, connect, or open of PID 1's files
    assert "pidfd_getfd -1 1" in out, out  # EPERM: cannot steal PID 1's socket


async def test_pid_1_survives_signals_from_inside(client: corral.AsyncClient) -> None:
    sbx = await client.sandboxes.create(image=IMAGE)
    r = await sbx.commands.run("kill -9 1; kill -TERM 1; kill -SEGV 1; echo sent")
    assert r.stdout == "sent\n"
    assert (await sbx.commands.run("echo alive")).stdout == "alive\n"


async def test_commands_cannot_see_the_agents_socket_fd(client: corral.AsyncClient) -> None:
    sbx = await client.sandboxes.create(image=IMAGE)
    r = await sbx.commands.run("ls -l /proc/self/fd/ | grep -c socket || true")
    assert r.stdout.strip() == "0"


async def test_a_reused_compiled_filter_still_refuses_and_counts(
    embedded: corral.AsyncClient, node_config: NodeConfig
) -> None:
    # The second sandbox gets the filter compiled once for every sandbox
    # (crun: run.oci.seccomp_bpf_data; corral-run: the filter's file): it
    # must refuse, and report, the same.
    first = await embedded.sandboxes.create(image=IMAGE)
    second = await embedded.sandboxes.create(image=IMAGE)
    if node_config.oci_runtime == "crun":
        config = json.loads((node_config.crun_root / second.id / "config.json").read_text())
        assert "run.oci.seccomp_bpf_data" in config.get("annotations", {})
    else:
        assert list(node_config.crun_root.parent.glob("filter-*.bpf"))
    probe = (
        "python3 -c 'import ctypes; l = ctypes.CDLL(None, use_errno=True); "
        "print(l.syscall(165, 0, 0, 0, 0, 0), ctypes.get_errno())'"
    )
    r = await second.commands.run(probe)
    assert r.stdout.split() == ["-1", "1"]
    assert (await second.audit()).syscalls.get("mount") == 1
    await asyncio.gather(first.close(), second.close())


async def test_refused_syscall_counts_outlive_the_close_but_not_their_file(
    embedded: corral.AsyncClient, node_config: NodeConfig
) -> None:
    # The seccomp daemon counts in a file per sandbox, made by its first
    # refused call (most sandboxes are refused nothing: no file); at close
    # the counts go into the sandbox's records and the file goes (one
    # stayed for every sandbox ever made).
    sbx = await embedded.sandboxes.create(image=IMAGE)
    counts = node_config.data_dir / "audit" / f"{sbx.id}.seccomp"
    assert (await sbx.commands.run("true")).exit_code == 0
    assert not counts.exists()
    probe = (
        "python3 -c 'import ctypes; l = ctypes.CDLL(None, use_errno=True); "
        "[l.syscall(165, 0, 0, 0, 0, 0) for _ in range(3)]'"
    )
    await sbx.commands.run(probe)
    live = await sbx.audit()
    assert live.syscalls.get("mount") == 3, live.syscalls
    assert counts.exists()
    await sbx.close()
    after = await sbx.audit()
    assert not counts.exists()
    assert after.syscalls == live.syscalls
    assert after.syscalls_denied == live.syscalls_denied
