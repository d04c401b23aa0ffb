"""One SDK over every backend: the same tests, parametrized over `kind`.

A microVM boots its own kernel (QEMU, TCG here) with the image's layers as
drives and the agent on a serial port; what a caller sees must be what a
container gives: output and exit status, env and stdin, streaming, timeouts,
output caps, background commands, files, and nothing left after close.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

import corral
from corral import metrics
from corral.node import signing as states

from ..framework import IMAGE, Node, Server, png_pixels

VM_KINDS = ["microvm", "fullvm"]
KINDS = ["container", *(pytest.param(k, marks=pytest.mark.requires_qemu) for k in VM_KINDS)]


@pytest.fixture(params=KINDS)
async def sbx(
    request: pytest.FixtureRequest, embedded: corral.AsyncClient
) -> AsyncIterator[corral.AsyncSandbox]:
    kind = request.param
    s = await embedded.sandboxes.create(
        kind=kind, image=IMAGE, memory="384MiB", disk="256MiB", env={"FROM_CREATE": "yes"}
    )
    yield s
    await s.close()


async def test_exit_status_streams_env_and_stdin(sbx: corral.AsyncSandbox) -> None:
    r = await sbx.commands.run("echo out; echo err >&2; exit 7")
    assert (r.exit_code, r.stdout, r.stderr) == (7, "out\n", "err\n")
    r = await sbx.commands.run(["python3", "-c", "import sys; print(sys.argv[1])", "$HOME;x"])
    assert r.stdout == "$HOME;x\n"
    assert (await sbx.commands.run("echo $FROM_CREATE $A", env={"A": "b"})).stdout == "yes b\n"
    assert (await sbx.commands.run("pwd", cwd="/tmp")).stdout == "/tmp\n"
    assert (await sbx.commands.run("wc -c", stdin=b"x" * 300_000)).stdout.strip() == "300000"
    r = await sbx.commands.run("id -u", user="nobody")
    assert r.stdout.strip() == "65534"


async def test_output_streams_before_the_command_ends(sbx: corral.AsyncSandbox) -> None:
    seen: list[tuple[float, str]] = []
    t0 = time.monotonic()
    r = await sbx.commands.run(
        "echo first; sleep 1.5; echo second",
        on_stdout=lambda chunk: seen.append((time.monotonic() - t0, chunk)),
    )
    assert r.stdout == "first\nsecond\n"
    first = next(t for t, chunk in seen if "first" in chunk)
    assert first < r.duration - 1.0, seen  # it arrived while the command slept


async def test_timeouts_caps_and_background_commands(sbx: corral.AsyncSandbox) -> None:
    t0 = time.monotonic()
    with pytest.raises(corral.CommandTimeout):
        await sbx.commands.run("sleep 30", timeout=1)
    assert time.monotonic() - t0 < 10
    r = await sbx.commands.run("head -c 3000000 /dev/zero | tr '\\0' a", stdout_limit=1000)
    assert len(r.stdout) == 1000 and r.truncated
    h = await sbx.commands.start("sleep 0.5; echo done")
    assert (await sbx.commands.run("echo meanwhile")).stdout == "meanwhile\n"
    assert (await h.wait(30)).stdout == "done\n"


async def test_files(sbx: corral.AsyncSandbox) -> None:
    await sbx.files.write("/work/dir/a.txt", b"hello " * 1000)
    assert await sbx.files.read("/work/dir/a.txt") == b"hello " * 1000
    await sbx.files.make_dir("/work/dir/sub")
    names = sorted(e.name for e in await sbx.files.list("/work/dir"))
    assert names == ["a.txt", "sub"]
    assert (await sbx.files.stat("/work/dir/a.txt")).size == 6000
    await sbx.files.remove("/work/dir")
    with pytest.raises(corral.FileNotFound):
        await sbx.files.read("/work/dir/a.txt")
    # The image's own files are there, read through its layers.
    assert b"bookworm" in await sbx.files.read("/etc/os-release")


@pytest.mark.requires_qemu
@pytest.mark.parametrize("kind", VM_KINDS)
async def test_close_leaves_no_process(embedded: corral.AsyncClient, node: Node, kind: str) -> None:
    s = await embedded.sandboxes.create(kind=kind, image=IMAGE, memory="256MiB")
    assert (await s.commands.run("true")).exit_code == 0
    assert len(node.qemu_processes(s.id)) == 1  # so the check below can see one
    await s.close()
    await asyncio.sleep(0.2)
    assert node.qemu_processes(s.id) == []
    with pytest.raises(corral.SandboxClosed):
        await s.commands.run("true")


@pytest.mark.requires_qemu
@pytest.mark.parametrize("kind", VM_KINDS)
async def test_a_suspended_vm_resumes_where_it_was(
    embedded: corral.AsyncClient, node: Node, kind: str
) -> None:
    """Memory, processes and files survive suspend; the next request
    resumes it. (A container's suspend: tests/integration/test_suspend.py.)"""
    s = await embedded.sandboxes.create(kind=kind, image=IMAGE, memory="384MiB")
    try:
        await s.files.write("/work/note", b"written before")
        # A process whose state lives only in memory: it counts, and says
        # how far it got when asked.
        counter = await s.commands.start(
            "python3 -c 'import time, os\n"
            "n = 0\n"
            'while not os.path.exists("/tmp/stop"):\n'
            "    n += 1; time.sleep(0.01)\n"
            'print("counted", n > 0, os.getpid())\''
        )
        await asyncio.sleep(1)
        info = await s.suspend()
        assert info.state.value == "suspended"
        assert node.qemu_processes(s.id) == []  # no process while suspended: its memory is free
        # The next request resumes it, by itself.
        assert await s.files.read("/work/note") == b"written before"
        assert (await s.refresh()).state.value == "running"
        r = await s.commands.run(f"kill -0 {counter.pid} && echo still-running")
        assert r.stdout == "still-running\n"
        await s.commands.run("touch /tmp/stop")
        assert (await s.resume()).state.value == "running"  # a no-op now
        # Suspended twice: the second resume is explicit.
        await s.suspend()
        assert (await s.resume()).state.value == "running"
        assert (await s.commands.run("echo again")).stdout == "again\n"
    finally:
        await s.close()


def _reseeds(kernel: str) -> float:
    value = metrics.REGISTRY.get_sample_value(
        "corral_copy_reseeds_total", {"kernel": kernel, "outcome": "ok"}
    )
    return value or 0.0


def _until(path: str, seconds: int = 30) -> str:
    """A shell loop that waits (at most `seconds`) for `path` to exist."""
    return f"for i in $(seq {seconds * 20}); do [ -e {path} ] && break; sleep 0.05; done"


@pytest.mark.requires_qemu
@pytest.mark.parametrize("kind", VM_KINDS)
async def test_fork_copies_a_running_vm(embedded: corral.AsyncClient, kind: str) -> None:
    """Each copy has the source's memory, processes and files as they were
    at the fork, and goes its own way from there; the source runs on."""
    src = await embedded.sandboxes.create(kind=kind, image=IMAGE, memory="256MiB")
    copies: list[corral.AsyncSandbox] = []
    try:
        await src.files.write("/work/note", b"before the fork")
        # A process that holds a number only in memory and serves it. Its
        # files appear whole (written aside, then renamed): the test waits
        # for them to exist, and a loaded guest can be seen between the
        # create and the write.
        server = await src.commands.start(
            "python3 -c 'import os, time\n"
            "def put(path, text):\n"
            '    open(path + ".new", "w").write(text); os.rename(path + ".new", path)\n'
            "secret = os.urandom(8).hex()\n"
            'put("/tmp/pid", str(os.getpid()))\n'
            "while True:\n"
            '    if os.path.exists("/tmp/ask"):\n'
            '        put("/tmp/answer", secret); os.remove("/tmp/ask")\n'
            "    time.sleep(0.05)\n'"
        )
        # Waits for the server's answers, not for fixed times: a TCG guest
        # under load starts python in seconds.
        await src.commands.run(_until("/tmp/pid"))
        await src.commands.run("touch /tmp/ask; " + _until("/tmp/answer"))
        secret = await src.files.read("/tmp/answer")
        reseeded = _reseeds("guest")
        copies = await embedded.sandboxes.fork(src, 2 if kind == "fullvm" else 3)
        assert len({c.id for c in copies} | {src.id}) == len(copies) + 1
        # Each copy's guest kernel was given its own entropy and re-keyed.
        assert _reseeds("guest") == reseeded + len(copies)
        draws = [
            (await c.commands.run("head -c16 /dev/urandom | od -An -x")).stdout for c in copies
        ]
        assert len(set(draws)) == len(copies), draws
        for c in copies:
            assert c.info.labels["corral.forked_from"] == src.id
            assert c.info.kind == kind and c.info.state.value == "running"
            assert await c.files.read("/work/note") == b"before the fork"
            # The same process, with the same memory, still serving.
            await c.commands.run("rm -f /tmp/answer; touch /tmp/ask; " + _until("/tmp/answer"))
            assert await c.files.read("/tmp/answer") == secret
            pid = (await c.commands.run("cat /tmp/pid")).stdout
            assert (await c.commands.run(f"kill -0 {pid} && echo up")).stdout == "up\n"
        # From here each goes its own way.
        await copies[0].files.write("/work/note", b"copy 0")
        assert await src.files.read("/work/note") == b"before the fork"
        assert await copies[1].files.read("/work/note") == b"before the fork"
        assert (await src.commands.run(f"kill -0 {server.pid} && echo up")).stdout == "up\n"
        await copies[0].close()  # closing a copy leaves the rest
        assert (await copies[1].commands.run("echo ok")).stdout == "ok\n"
        with pytest.raises(corral.InvalidArgument) as e:
            await embedded.sandboxes.fork(src, 0)
        assert e.value.field == "n"
    finally:
        await asyncio.gather(*(c.close() for c in copies), return_exceptions=True)
        await src.close()


async def test_fork_and_save_are_not_for_function_call_workers(
    embedded: corral.AsyncClient,
) -> None:
    # (Containers fork and save with CRIU: tests/integration/test_checkpoints.py.)
    s = await embedded.sandboxes.create(kind="fncall", image="fncall:bookworm", memory="256MiB")
    try:
        with pytest.raises(corral.InvalidArgument) as e:
            await embedded.sandboxes.fork(s, 2)
        assert e.value.field == "kind"
        with pytest.raises(corral.InvalidArgument) as e:
            await s.save()
        assert e.value.field == "kind"
        assert (await s.refresh()).state.value == "running"  # nothing was touched
    finally:
        await s.close()


@pytest.mark.requires_qemu
async def test_vm_lifecycle_over_http(server: Server) -> None:
    """suspend, resume, fork and the display through `corral serve`: the
    same calls, over the wire (their errors too)."""
    async with corral.AsyncClient(server.url) as c:
        s = await c.sandboxes.create(kind="fullvm", image=IMAGE, memory="384MiB")
        copies: list[corral.AsyncSandbox] = []
        try:
            assert s.display.size == (1024, 768)
            png = await s.display.screenshot()
            assert png.startswith(b"\x89PNG") and png_pixels(png)[:2] == (1024, 768)
            await s.display.key("shift")
            with pytest.raises(corral.InvalidArgument) as e:
                await s.display.click(1024, 0)
            assert e.value.field == "x"
            await s.files.write("/work/f", b"kept")
            assert (await s.suspend()).state.value == "suspended"
            assert (await c.sandboxes.get(s.id)).info.state.value == "suspended"
            assert (await s.resume()).state.value == "running"
            copies = await c.sandboxes.fork(s, 1)
            assert await copies[0].files.read("/work/f") == b"kept"
            with pytest.raises(corral.InvalidArgument) as e:
                await c.sandboxes.fork(s, 33)
            assert e.value.field == "n"
        finally:
            await asyncio.gather(*(x.close() for x in [*copies, s]))


@pytest.mark.requires_qemu
async def test_a_saved_vm_is_restored_on_another_node(
    embedded: corral.AsyncClient, fresh_node: Node, tmp_path: Path
) -> None:
    """Saved to a shared store on one node, restored on another: the same
    process, its memory and its files; the source stays suspended."""
    # "local": the store every node sharing the image store has.
    store = fresh_node.config.object_stores["local"]
    src = await embedded.sandboxes.create(kind="microvm", image=IMAGE, memory="256MiB")
    try:
        await src.files.write("/work/note", b"saved here")
        proc = await src.commands.start("sleep 600")
        # Stores are the operator's, by name: never a path or URL of ours.
        for bad in ("/tmp/anywhere", "http://169.254.169.254/latest", "../saved", "nope"):
            with pytest.raises(corral.InvalidArgument) as e:
                await src.save(bad)
            assert e.value.field == "store", bad
        assert (await src.refresh()).state.value == "running"  # nothing was touched
        saved = await src.save()
        assert saved.store == "local" and saved.memory == 256 << 20 and saved.project is None
        assert saved.sandbox == src.id and saved.size > 0
        assert (await src.refresh()).state.value == "suspended"
        async with fresh_node.client() as other:
            moved = await other.sandboxes.restore(saved)
            try:
                assert moved.id.split("-")[0] == fresh_node.name != src.id.split("-")[0]
                assert moved.info.labels["corral.restored_from"] == src.id
                assert await moved.files.read("/work/note") == b"saved here"
                r = await moved.commands.run(f"kill -0 {proc.pid} && echo alive")
                assert r.stdout == "alive\n"
            finally:
                await moved.close()
            with pytest.raises(corral.InvalidArgument) as e:
                await other.sandboxes.restore(
                    {**saved.model_dump(), "key": "vmstates/x-0000000000000000"}
                )
            assert e.value.field == "key"
            # Another project's state looks like none; a size other than the
            # signed one (a gateway charges by it) is refused by name.
            for change, field in (({"project": "other"}, "key"), ({"memory": 1 << 20}, "memory"),
                                  ({"store": "/tmp/x"}, "store"), ({"store": "nope"}, "store")):  # fmt: skip
                with pytest.raises(corral.InvalidArgument) as e:
                    await other.sandboxes.restore({**saved.model_dump(), **change})
                assert e.value.field == field, change
            # Saved states are signed: a changed record is refused, a state
            # file that does not match its record never reaches QEMU, and a
            # (signed) record of other guest artefacts does not load here.
            obj = Path(store) / saved.key
            record, mac = (obj / "saved.json").read_bytes(), (obj / "mac").read_text()
            other_guest = json.dumps({**json.loads(record), "guest": "0" * 16}).encode()
            (obj / "saved.json").write_bytes(other_guest)
            with pytest.raises(corral.InvalidArgument, match="signature") as e:
                await other.sandboxes.restore(saved)
            assert e.value.field == "key"
            key = states.load_key(fresh_node.config.state_key_path)
            (obj / "mac").write_text(states.sign(key, saved.key, other_guest))
            with pytest.raises(corral.InvalidArgument) as e:
                await other.sandboxes.restore(saved)
            assert e.value.field == "guest"
            (obj / "saved.json").write_bytes(record)
            (obj / "mac").write_text(mac)
            with open(obj / "state", "r+b") as f:
                f.seek(4096)
                byte = f.read(1)
                f.seek(4096)
                f.write(bytes([byte[0] ^ 0xFF]))
            with pytest.raises(corral.InvalidArgument, match="does not match") as e:
                await other.sandboxes.restore(saved)
            assert e.value.field == "key"
            assert [x.id for x in await other.sandboxes.list()] == []
        # The source is still there, suspended, and resumes.
        assert (await src.resume()).state.value == "running"
        assert await src.files.read("/work/note") == b"saved here"
    finally:
        await src.close()
