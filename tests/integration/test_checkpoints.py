"""Container checkpoints that move (CRIU): fork a running container into
copies, save one to a store and restore it on another node; the copies
live in their own id blocks and cgroups; a tampered checkpoint is refused
and its source is untouched."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import corral
from corral import metrics
from corral.execd import protocol as proto
from corral.execd.client import ExecdClient
from corral.host.cgroups import Cgroups, Mode
from corral.node.lifecycle import control_path
from corral.runtimes.container import criu

from ..framework import IMAGE, Node, zombies_of_this_process

SECRET = (
    'nohup python3 -c "\nimport os,time\nsecret=os.urandom(8).hex()\nn=0\n'
    "while True:\n  n+=1\n"
    # Replaced, not rewritten in place: a read never finds it empty.
    "  open('/tmp/ticks.new','w').write(str(n)); os.replace('/tmp/ticks.new', '/tmp/ticks')\n"
    "  if os.path.exists('/tmp/ask'):\n"
    "    open('/tmp/answer.new','w').write(secret); os.replace('/tmp/answer.new', '/tmp/answer')\n"
    "    os.remove('/tmp/ask')\n"
    '  time.sleep(0.05)\n" >/dev/null 2>&1 &'
)


@pytest.fixture(autouse=True)
def _criu() -> None:
    if criu.available() is not None:
        pytest.fail(f"container checkpoints need CRIU: {criu.available()} (make install builds it)")


def _host_reseeds() -> float:
    value = metrics.REGISTRY.get_sample_value(
        "corral_copy_reseeds_total", {"kernel": "host", "outcome": "ok"}
    )
    return value or 0.0


LIMIT_FILES = ("memory.max", "memory.limit_in_bytes", "pids.max", "cpu.max", "cpu.cfs_quota_us",
               "io.max", "blkio.throttle.read_bps_device", "blkio.throttle.write_bps_device")  # fmt: skip


def _limits(cg: Cgroups, sandbox_id: str) -> dict[str, str]:
    out = {}
    for h in cg.all:
        for name in LIMIT_FILES:
            f = h / cg.parent / sandbox_id / name
            if f.exists():
                out[name] = f.read_text().strip()
    assert any(k.startswith(("io", "blkio")) and v for k, v in out.items()), out
    return out


async def _secret(sbx: corral.AsyncSandbox) -> str:
    """Ask the program for its secret and wait for the answer (it may not
    have started yet: a Python start under CI's load took over 0.8 s, in
    the v2 guest on one TCG thread over 30 s)."""
    await sbx.commands.run("rm -f /tmp/answer; touch /tmp/ask")
    deadline = time.monotonic() + 120
    while True:
        try:
            return await sbx.files.read_text("/tmp/answer")
        except corral.FileNotFound:
            assert time.monotonic() < deadline, "the program never answered"
            await asyncio.sleep(0.1)


async def _ticking(sbx: corral.AsyncSandbox) -> bool:
    a = int(await sbx.files.read_text("/tmp/ticks"))
    await asyncio.sleep(0.25)
    return int(await sbx.files.read_text("/tmp/ticks")) > a


async def test_a_container_forks_into_copies_of_its_memory_and_files(node: Node) -> None:
    async with node.client() as c:
        src = await c.sandboxes.create(image=IMAGE, memory="128MiB")
        copies: list[corral.AsyncSandbox] = []
        try:
            await src.files.write("/work/note", "before the fork")
            await src.commands.run("chown 1000:1000 /work/note")
            await src.commands.run(SECRET)
            await asyncio.sleep(0.5)
            secret = await _secret(src)
            reseeded = _host_reseeds()
            copies = await c.sandboxes.fork(src, 2, idempotency_key="fk")
            assert len({x.id for x in copies} | {src.id}) == 3
            assert _host_reseeds() == reseeded + 1  # the host CRNG, once for both
            cg = node.agent.parts.cgroups
            for x in copies:
                # The ceilings crun writes for a sandbox it starts, written
                # for the copies CRIU restores (no limit lifted by a fork).
                assert _limits(cg, x.id) == _limits(cg, src.id)
            for x in copies:
                assert x.info.labels["corral.forked_from"] == src.id
                assert x.info.state.value == "running"
                # The same process, with the same memory, running on.
                assert await _secret(x) == secret
                assert await _ticking(x)
                # Its files, owned as they were, in its own id block.
                r = await x.commands.run("stat -c %u /work/note; cat /work/note")
                assert r.stdout == "1000\nbefore the fork"
            assert await _ticking(src)
            again = await c.sandboxes.fork(src, 2, idempotency_key="fk")  # a retry
            assert [x.id for x in again] == [x.id for x in copies]
            slots = {node.idmap_slot(x.id) for x in [src, *copies]}
            assert len(slots) == 3  # each its own user-namespace block
            await copies[0].files.write("/work/note", "copy 0")
            assert await src.files.read_text("/work/note") == "before the fork"
            assert await copies[1].files.read_text("/work/note") == "before the fork"
            await copies[0].close()
            assert node.resources(copies[0].id) == []
            assert (await copies[1].commands.run("echo ok")).stdout == "ok\n"
        finally:
            await asyncio.gather(*(x.close() for x in [*copies, src]), return_exceptions=True)
        # Nothing of the copies stays: their cgroups (nested ones too) are gone.
        cg = node.agent.parts.cgroups
        for x in [src, *copies]:
            assert not [h for h in cg.all if (h / cg.parent / x.id).exists()]
        # Nor a dead init in this (embedded) process: CRIU restored each as
        # a child of criu, not of the caller (--restore-sibling had made
        # every closed copy a zombie of the caller's process, for good).
        assert zombies_of_this_process() == []


async def test_forks_and_a_suspend_of_one_source_at_once_each_see_it_whole(node: Node) -> None:
    """Two forks and a freeze asked at once: the saves and the freeze take
    turns (two CRIU dumps of one tree, or a freeze under a dump, had failed
    a fork or left the source thawed under "suspended"). Each fork copies
    the running program; the source ends frozen or running, and whole."""
    async with node.client() as c:
        src = await c.sandboxes.create(image=IMAGE, memory="128MiB")
        try:
            await src.commands.run(SECRET)
            secret = await _secret(src)
            for round_ in range(3):
                results = await asyncio.gather(
                    c.sandboxes.fork(src, 1), c.sandboxes.fork(src, 1), src.suspend("freeze"),
                    return_exceptions=True,
                )  # fmt: skip
                *forks, frozen = results
                # The freeze may be refused while a fork wakes the source.
                assert isinstance(frozen, corral.SandboxInfo | corral.Conflict), (round_, frozen)
                for copies in forks:
                    assert isinstance(copies, list), (round_, copies)
                    (copy,) = copies
                    assert await _secret(copy) == secret, round_
                    assert await _ticking(copy), round_
                    await copy.close()
                    assert node.resources(copy.id) == []
                info = await src.refresh()
                if isinstance(frozen, corral.SandboxInfo) and info.state.value == "suspended":
                    # Frozen means stopped: no tick while it is.
                    before = await asyncio.to_thread(_host_ticks, node, src.id)
                    await asyncio.sleep(0.3)
                    assert await asyncio.to_thread(_host_ticks, node, src.id) == before, round_
                assert await _secret(src) == secret, round_  # the next request resumes it
                assert await _ticking(src), round_
        finally:
            await src.close()
        assert node.resources(src.id) == []


def _host_ticks(node: Node, sandbox_id: str) -> str:
    """The counter, read from the host through the frozen sandbox's root
    (a request would resume it)."""
    rec = node.record(sandbox_id)
    assert rec is not None and rec.init_pid is not None
    return Path(f"/proc/{rec.init_pid}/root/tmp/ticks").read_text()


def _cgroups_of(pid: int) -> dict[str, str]:
    """hierarchy ("memory", "cpu,cpuacct", "" for cgroup2) -> path."""
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    return {name: path for _, name, path in (line.split(":", 2) for line in lines)}


async def test_copies_of_copies_keep_their_cgroups_at_the_nodes_path(node: Node) -> None:
    """Three generations (a fork's copy forked again, that copy suspended
    to disk and resumed): each sandbox's init is in a cgroup of its own in
    every hierarchy the node manages, at the node's path, never below its
    source's. On a hybrid host CRIU is kept off the cgroup2 mount, where
    a sandbox crun starts stays in the node agent's cgroup: so do copies
    (before, each generation's landed one level deeper, below its
    source's, and every dump walked the whole mount)."""
    ours = _cgroups_of(os.getpid())  # the embedded agent's
    async with node.client() as c:
        cgroups = node.agent.parts.cgroups
        chain = [await c.sandboxes.create(image=IMAGE, memory="64MiB")]
        try:
            for _ in range(2):
                (copy,) = await c.sandboxes.fork(chain[-1], 1)
                chain.append(copy)
            await chain[-1].suspend("disk")
            await chain[-1].resume()
            for sbx in chain:
                rec = node.record(sbx.id)
                assert rec is not None and rec.init_pid is not None
                seen = _cgroups_of(rec.init_pid)
                parent = cgroups.parent
                own = f"/{parent}/{sbx.id}"
                for name, path in seen.items():
                    if name == "" and cgroups.mode is Mode.HYBRID:
                        assert path == ours[""], (sbx.id, seen)
                    else:  # its own (or below it: a v2 leaf), and nobody's above it
                        assert path == own or path.startswith(f"{own}/"), (sbx.id, name, seen)
                        assert path.count(parent) == 1, (sbx.id, name, seen)
        finally:
            await asyncio.gather(*(x.close() for x in chain), return_exceptions=True)


async def test_a_fork_is_refused_while_a_command_runs(node: Node) -> None:
    async with node.with_config(checkpoint_wait=0.5).client() as c:
        src = await c.sandboxes.create(image=IMAGE, memory="64MiB")
        try:
            bg = await src.commands.start("sleep 30")
            with pytest.raises(corral.Conflict, match="command"):
                await c.sandboxes.fork(src, 1)
            await bg.kill()
            assert (await src.refresh()).state.value == "running"
        finally:
            await src.close()


async def test_a_saved_container_is_restored_on_another_node(node: Node, fresh_node: Node) -> None:
    store = Path(fresh_node.config.object_stores["local"])
    async with node.client() as c:
        src = await c.sandboxes.create(image=IMAGE, memory="128MiB")
        try:
            await src.files.write("/work/note", "saved here")
            await src.commands.run(SECRET)
            await asyncio.sleep(0.5)
            secret = await _secret(src)
            saved = await src.save()
            assert saved.kind == "container" and saved.size > 0
            assert saved.guest.startswith("criu-")
            assert (await src.refresh()).state.value == "suspended"
            async with fresh_node.client() as other:
                moved = await other.sandboxes.restore(saved)
                try:
                    assert moved.id.split("-")[0] == fresh_node.name
                    assert moved.info.labels["corral.restored_from"] == src.id
                    assert await moved.files.read_text("/work/note") == "saved here"
                    assert await _secret(moved) == secret
                    assert await _ticking(moved)
                finally:
                    await moved.close()
                assert fresh_node.resources(moved.id) == []
                # Another project's checkpoint looks like none.
                with pytest.raises(corral.InvalidArgument) as e:
                    await other.sandboxes.restore({**saved.model_dump(), "project": "other"})
                assert e.value.field == "key"
                # A truncated checkpoint never reaches CRIU; nothing is made.
                obj = store / saved.key / "state"
                whole = obj.read_bytes()
                obj.write_bytes(whole[: len(whole) // 2])
                with pytest.raises(corral.InvalidArgument, match="does not match") as e:
                    await other.sandboxes.restore(saved)
                assert e.value.field == "key"
                record = json.loads((store / saved.key / "saved.json").read_bytes())
                assert record["kind"] == "container"
                assert [x.id for x in await other.sandboxes.list()] == []
            # The source is untouched: suspended, and it resumes.
            assert (await src.resume()).state.value == "running"
            assert await _secret(src) == secret
        finally:
            await src.close()


async def test_requests_during_a_fork_wait_for_its_save(node: Node) -> None:
    """Commands and file reads sent one after another while the source is
    saved each wait for the save and run (half of them had failed as if
    the sandbox had died: the save parks its exec server)."""
    async with node.client() as c:
        src = await c.sandboxes.create(image=IMAGE, memory="128MiB")
        try:
            await src.files.write("/tmp/note", "kept")
            forking = asyncio.create_task(c.sandboxes.fork(src, 1))
            answers: list[int] = []
            while not forking.done() or len(answers) < 10:
                i = len(answers)
                r = await src.commands.run(f"echo {i}")
                assert r.stdout == f"{i}\n", (i, r)
                assert await src.files.read_text("/tmp/note") == "kept", i
                answers.append(i)
                await asyncio.sleep(0.002)
            (copy,) = await forking
            assert await copy.files.read_text("/tmp/note") == "kept"
            await copy.close()
        finally:
            await src.close()


async def test_a_request_during_a_save_waits_and_the_saved_moment_holds(
    node: Node, fresh_node: Node
) -> None:
    """A command sent while a save suspends the sandbox resumes it only
    once the state is packed and stored (a resume during the pack had
    removed CRIU's images under tar and let later writes into the copy)."""
    async with node.client() as c:
        src = await c.sandboxes.create(image=IMAGE, memory="128MiB")
        try:
            await src.commands.run(SECRET)
            secret = await _secret(src)
            saving = asyncio.create_task(src.save())
            for _ in range(20000):  # polled: the state lives in the node's store
                rec = node.record(src.id)
                if rec is not None and rec.state != "running":
                    break
                await asyncio.sleep(0.0005)
            after = await src.commands.run("mkdir -p /work && echo later > /work/after && echo ok")
            assert after.stdout == "ok\n", after
            saved = await saving
            async with fresh_node.client() as other:
                moved = await other.sandboxes.restore(saved)
                try:
                    assert await _secret(moved) == secret
                    with pytest.raises(corral.FileNotFound):
                        await moved.files.read_text("/work/after")
                finally:
                    await moved.close()
        finally:
            await src.close()
        assert node.resources(src.id) == []


async def test_requests_queued_when_a_save_parks_the_server_are_told_and_sent_again(
    node: Node,
) -> None:
    """Connections queued on the exec server's listener when a save parks
    it are answered ERR_PARKED (they had been reset without a word, and a
    request sent just before the save failed as 'lost its exec server'),
    and the node's client sends each again once the change has ended: each
    command runs once. Init is stopped while the park and the requests
    queue up behind one another, so the order is certain."""
    async with node.client() as c:
        s = await c.sandboxes.create(image=IMAGE, memory="64MiB")
        try:
            rec = node.record(s.id)
            assert rec is not None and rec.init_pid is not None
            pid, control = rec.init_pid, control_path(node.config.run_dir, s.id)
            nonce = "0123456789abcdef"
            parked = asyncio.Event()
            woken: asyncio.Task[None] | None = None

            async def wake() -> None:  # the save's end: a new listener
                await parked.wait()
                listener = criu.listen(control)
                try:
                    await asyncio.to_thread(criu.unpark, pid, nonce, listener)
                finally:
                    listener.close()

            async def settle() -> bool:
                nonlocal woken
                woken = woken or asyncio.create_task(wake())
                await asyncio.shield(woken)
                return True

            async def run(i: int) -> int:
                client = ExecdClient(str(control), settle=settle)
                session = await client.start(
                    ["sh", "-c", f"echo {i} >> /tmp/ran"], [], user="root", cwd="/",
                    timeout=30, stdout_cap=1024, stderr_cap=1024, stdin=None,
                )  # fmt: skip
                async for kind, payload in session.events():
                    if kind == proto.RSP_EXIT:
                        return proto.parse_exit(payload).exit_code
                raise AssertionError("no exit")

            os.kill(pid, signal.SIGSTOP)
            try:
                park = await ExecdClient(str(control)).connect()
                await park.send(proto.frame(proto.REQ_PARK, nonce.encode()))
                raw = await ExecdClient(str(control)).connect()
                await raw.send(proto.file_request(proto.REQ_STAT, "root", "/"))
                runs = [asyncio.create_task(run(i)) for i in range(3)]
                await asyncio.sleep(0.3)  # each has connected and sent
                assert not any(r.done() for r in runs)
            finally:
                os.kill(pid, signal.SIGCONT)
            assert (await park.recv()).kind == proto.RSP_OK
            with pytest.raises(ConnectionError):
                await park.recv()  # init closes it once parked
            parked.set()
            told = await raw.recv()
            assert told.kind == proto.RSP_ERROR
            err = proto.parse_error(told.payload)
            assert (err.errno, err.stage) == (errno.EAGAIN, proto.ERR_PARKED), err
            raw.close()
            park.close()
            assert await asyncio.gather(*runs) == [0, 0, 0]
            ran = await s.files.read_text("/tmp/ran")
            assert sorted(ran.split()) == ["0", "1", "2"], ran  # each once
        finally:
            await s.close()


@pytest.mark.parametrize(("entropy", "errno_name"), [
    (b"", "EINVAL"),             # nothing to credit
    (b"x" * 31, "EINVAL"),       # too little to re-key from
    (b"x" * 513, "EINVAL"),      # more than the request's bound
    (b"x" * 64, "EPERM"),        # a container's kernel is the host's: init may not touch it
])  # fmt: skip
async def test_a_reseed_request_init_cannot_honour_is_refused(
    node: Node, entropy: bytes, errno_name: str
) -> None:
    async with node.client() as c:
        s = await c.sandboxes.create(image=IMAGE, memory="64MiB")
        try:
            client = ExecdClient(str(control_path(node.config.run_dir, s.id)))
            with pytest.raises(corral.FileError) as e:
                await client.reseed(entropy)
            assert e.value.details["strerror"] == errno_name
            assert (await s.commands.run("echo ok")).stdout == "ok\n"  # init serves on
        finally:
            await s.close()


# Three calls the guard sends to corral-seccompd: two it refuses (EPERM,
# counted), one it lets through within the sandbox's AIO budget. From a
# process that was running before the checkpoint, and a new one after.
PROBE = (
    "import ctypes, os\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "def call(*args):\n"
    "    r = libc.syscall(*args)\n"
    "    return r if r >= 0 else -ctypes.get_errno()\n"
    "ctx = ctypes.c_ulong(0)\n"
    "print(call(165, b'none', b'/tmp', b'tmpfs', 0, None), call(272, 0x20000), "
    "call(206, 8, ctypes.byref(ctx)))\n"
)
PROBED = "-1 -1 0\n"  # mount, unshare: EPERM; io_setup: granted
LIVE_PROBE = (
    'nohup python3 -c "\nimport os, time\n'
    "while True:\n"
    "  if os.path.exists('/tmp/probe'):\n"
    "    os.remove('/tmp/probe')\n"
    "    exec(open('/tmp/probe.py').read().replace('print(', 'res = ('))\n"
    "    open('/tmp/probed', 'w').write(' '.join(map(str, res)) + chr(10))\n"
    '  time.sleep(0.05)\n" >/dev/null 2>&1 &'
)


async def _probe(sbx: corral.AsyncSandbox) -> tuple[str, str]:
    """(what a new process sees, what the process running since before sees)."""
    fresh = await sbx.commands.run("python3 /tmp/probe.py")
    await sbx.commands.run("rm -f /tmp/probed; touch /tmp/probe; sleep 0.5")
    return fresh.stdout, await sbx.files.read_text("/tmp/probed")


async def test_the_guard_still_answers_and_counts_after_a_restore(node: Node) -> None:
    """CRIU gives tasks back their filters but not the listener: without
    corral-relisten every notified call would be ENOSYS and uncounted."""
    async with node.client() as c:
        src = await c.sandboxes.create(image=IMAGE, memory="128MiB")
        copies: list[corral.AsyncSandbox] = []
        try:
            await src.files.write("/tmp/probe.py", PROBE)
            await src.commands.run(LIVE_PROBE)
            await asyncio.sleep(0.3)
            assert await _probe(src) == (PROBED, PROBED)
            before = (await src.audit()).syscalls
            await src.suspend("disk")
            assert await _probe(src) == (PROBED, PROBED)  # resumed by the request
            after = (await src.audit()).syscalls
            for name in ("mount", "unshare"):
                assert after.get(name, 0) == before.get(name, 0) + 2, (name, before, after)
            await src.suspend("disk")  # again: the filter stacked last time is restored too
            assert await _probe(src) == (PROBED, PROBED)
            copies = await c.sandboxes.fork(src, 2)
            for x in copies:
                assert await _probe(x) == (PROBED, PROBED)
                assert (await x.audit()).syscalls.get("mount") == 2
        finally:
            await asyncio.gather(*(x.close() for x in [*copies, src]), return_exceptions=True)


@pytest.mark.parametrize("args", [
    [],                                                  # nothing
    ["--socket", "/nonexistent"],                        # no id, no tasks
    ["--socket", "/x", "--id", "a\"b", "/dev/null"],     # an id that would break the metadata
    ["--socket", "/x", "--id", "a" * 49, "/dev/null"],   # longer than a sandbox id
    ["--socket", "/x", "--id", "ok"],                    # no tasks file
])  # fmt: skip
def test_relisten_refuses_bad_arguments(args: list[str]) -> None:
    helper = Path(__file__).parents[2] / "build" / "platform" / "bin" / "corral-relisten"
    done = subprocess.run([str(helper), *args], capture_output=True, text=True, timeout=10)
    assert done.returncode == 2 and "usage: corral-relisten" in done.stderr
