"""Lifecycle: create, get, list, re-attach (also from another process), close."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import corral
from corral.config import NodeConfig

from ..framework import IMAGE


async def test_create_run_close(client: corral.AsyncClient) -> None:
    sbx = await client.sandboxes.create(image=IMAGE, memory="128MiB", labels={"t": "life"})
    assert sbx.info.state == corral.SandboxState.running
    assert sbx.id.startswith("t-")
    r = await sbx.commands.run("python3 -c 'print(6*7)'")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "42\n", "")
    await sbx.close()
    info = await sbx.refresh()
    assert info.state == corral.SandboxState.closed
    with pytest.raises(corral.SandboxClosed) as exc:
        await sbx.commands.run("true")
    assert sbx.id in exc.value.message
    await sbx.close()  # closing twice is fine


async def test_get_and_list_by_labels(client: corral.AsyncClient) -> None:
    a = await client.sandboxes.create(image=IMAGE, labels={"job": "j1", "role": "a"})
    b = await client.sandboxes.create(image=IMAGE, labels={"job": "j1", "role": "b"})
    c = await client.sandboxes.create(image=IMAGE, labels={"job": "j2"})
    again = await client.sandboxes.get(a.id)
    assert again.info.labels == {"job": "j1", "role": "a"}
    assert {s.id for s in await client.sandboxes.list({"job": "j1"})} == {a.id, b.id}
    assert [s.id for s in await client.sandboxes.list({"job": "j1", "role": "b"})] == [b.id]
    assert c.id not in {s.id for s in await client.sandboxes.list({"job": "j1"})}
    for s in (a, b, c):
        await s.close()
    assert await client.sandboxes.list({"job": "j1"}) == []


async def test_unknown_sandbox(client: corral.AsyncClient) -> None:
    with pytest.raises(corral.SandboxNotFound) as exc:
        await client.sandboxes.get("t-0000000000000000")
    assert "t-0000000000000000" in exc.value.message
    with pytest.raises(corral.SandboxNotFound) as exc:
        await client.sandboxes.get("othernode-0000000000000000")
    assert "othernode" in exc.value.message


async def test_reattach_from_another_process(
    embedded: corral.AsyncClient, node_config: NodeConfig
) -> None:
    sbx = await embedded.sandboxes.create(image=IMAGE)
    await sbx.files.write("/root/note", "from parent")
    script = textwrap.dedent(f"""
        import corral
        from corral.config import NodeConfig
        from pathlib import Path
        cfg = NodeConfig.from_env(data_dir={str(node_config.data_dir)!r}, node="t",
                                  images=Path({str(node_config.images_dir)!r}))
        with corral.Client(config=cfg) as c:
            s = c.sandboxes.get({sbx.id!r})
            r = s.commands.run("cat /root/note; echo ' and child' >> /root/note")
            print(r.stdout, end="")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "from parent"
    assert await sbx.files.read_text("/root/note") == "from parent and child\n"
    await sbx.close()


def test_blocking_client(node_config: NodeConfig) -> None:
    with corral.Client(config=node_config) as c:
        with c.sandboxes.create(image=IMAGE, memory="64MiB") as sbx:
            assert sbx.commands.run("echo hi").stdout == "hi\n"
            h = sbx.commands.start("sleep 30")
            assert h.pid > 1 and not h.done
            h.kill()
            assert h.wait().signal == 9
            sbx.files.write("/tmp/a", b"x")
            assert sbx.files.exists("/tmp/a")
            listed = [s for s in c.sandboxes.list() if s.id == sbx.id]
            assert isinstance(listed[0], corral.Sandbox)
            assert listed[0].commands.run("cat /tmp/a").stdout == "x"
        assert sbx.refresh().state == corral.SandboxState.closed


async def test_composed_layers_and_env(client: corral.AsyncClient) -> None:
    sbx = await client.sandboxes.create(
        image=IMAGE, workspace="ws-six:1.16.0", toolkit="pytest:8.3.3", env={"MY_VAR": "v1"}
    )
    assert sbx.info.workdir == "/workspace"
    r = await sbx.commands.run(
        "pwd; echo $MY_VAR; python3 -c 'import pytest, six; print(six.__version__)'"
    )
    assert r.stdout.split() == ["/workspace", "v1", "1.16.0"], r.stderr
    r = await sbx.commands.run("echo $MY_VAR $X", env={"MY_VAR": "v2", "X": "y"})
    assert r.stdout == "v2 y\n"
    # Writes land in the private upper layer, not in the shared layers.
    await sbx.commands.run("echo changed > /workspace/six.py")
    other = await client.sandboxes.create(image=IMAGE, workspace="ws-six:1.16.0")
    assert "changed" not in (await other.files.read_text("/workspace/six.py"))
    await sbx.close()
    await other.close()
