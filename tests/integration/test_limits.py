"""Limits enforced by the kernel: memory, pids, cpu, disk; no network."""

from __future__ import annotations

import shutil

import pytest

import corral
from corral.config import NodeConfig

from ..framework import IMAGE


async def test_memory_limit_kills_inside_only(embedded: corral.AsyncClient) -> None:
    sbx = await embedded.sandboxes.create(image=IMAGE, memory="64MiB")
    r = await sbx.commands.run(
        "python3 -c 'x = bytearray(200 * 1024 * 1024); print(len(x))'", timeout=60
    )
    assert r.exit_code != 0 and r.signal == 9 and r.stdout == ""
    # The sandbox (and its exec server) lives on.
    assert (await sbx.commands.run("echo alive")).stdout == "alive\n"
    r = await sbx.commands.run("python3 -c 'x = bytearray(20 * 1024 * 1024); print(len(x))'")
    assert r.stdout == "20971520\n"


async def test_pids_limit_stops_a_fork_bomb(embedded: corral.AsyncClient) -> None:
    sbx = await embedded.sandboxes.create(image=IMAGE, pids=32)
    r = await sbx.commands.run(
        "python3 -c '\n"
        "import os\n"
        "n = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            import time; time.sleep(30); os._exit(0)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print(n, e.errno)\n'",
        timeout=60,
    )
    forked, err = r.stdout.split()
    assert int(forked) < 32 and err == "11"  # EAGAIN from pids.max
    assert (await sbx.commands.run("echo alive", timeout=30)).stdout == "alive\n"


async def test_cpu_quota(embedded: corral.AsyncClient) -> None:
    sbx = await embedded.sandboxes.create(image=IMAGE, cpu=0.2)
    r = await sbx.commands.run(
        "python3 -c '\nimport time\nt = time.time()\nwhile time.time() - t < 2: pass\n'",
        timeout=30,
    )
    # A busy loop held to 0.2 of a core uses about 0.2 s of CPU a second
    # of its wall time (python's start included: slow on an emulated CPU),
    # against 1 s unlimited.
    assert r.cpu_user + r.cpu_system < 0.4 * r.duration, r


async def test_disk_limit_stops_writes_inside(
    embedded: corral.AsyncClient, node_config: NodeConfig
) -> None:
    host_free = shutil.disk_usage("/").free
    sbx = await embedded.sandboxes.create(image=IMAGE, disk="64MiB")
    r = await sbx.commands.run(
        "dd if=/dev/zero of=/big bs=1M count=200 2>&1; ls -s /big", timeout=60
    )
    assert "Disk quota exceeded" in r.stdout or "No space" in r.stdout
    size_kib = int(r.stdout.split()[-2])
    assert size_kib <= 64 * 1024
    assert shutil.disk_usage("/").free > host_free - 200 * 2**20
    # Freeing space works, and the sandbox goes on.
    await sbx.commands.run("rm /big")
    r = await sbx.commands.run("dd if=/dev/zero of=/small bs=1M count=10 2>&1 && echo ok")
    assert r.stdout.strip().endswith("ok")


async def test_no_network_but_loopback(embedded: corral.AsyncClient) -> None:
    sbx = await embedded.sandboxes.create(image=IMAGE)
    r = await sbx.commands.run("ls /sys/class/net")
    assert r.stdout.split() == ["lo"]
    r = await sbx.commands.run(
        "python3 -c '\nimport socket\ns = socket.socket()\ns.settimeout(3)\n"
        'try:\n    s.connect(("1.1.1.1", 80)); print("connected")\n'
        'except OSError as e:\n    print("blocked", e.errno)\n\''
    )
    assert r.stdout.startswith("blocked")
    # Loopback works for servers the agent starts.
    h = await sbx.commands.start("python3 -m http.server 8000 --bind 127.0.0.1")
    r = await sbx.commands.run(
        "for i in $(seq 50); do python3 -c 'import urllib.request as u; "
        'print(u.urlopen("http://127.0.0.1:8000/").status)\' 2>/dev/null && break; '
        "sleep 0.1; done"
    )
    assert r.stdout.strip() == "200"
    await h.kill()


async def test_an_unknown_kind_is_refused_by_name(embedded: corral.AsyncClient) -> None:
    with pytest.raises(corral.InvalidArgument) as exc:
        await embedded.sandboxes.create(kind="unikernel", image=IMAGE)
    assert exc.value.field == "kind" and "fullvm" in exc.value.rule
