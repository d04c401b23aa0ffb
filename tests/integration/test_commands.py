"""Commands: output, exit status, cwd/env/user/stdin, streaming, timeouts that
kill the whole tree, output caps, background commands."""

from __future__ import annotations

import asyncio
import time

import pytest

import corral
from corral.node import sessions

from ..framework import IMAGE


@pytest.fixture
async def sbx(client: corral.AsyncClient) -> corral.AsyncSandbox:
    return await client.sandboxes.create(image=IMAGE, memory="256MiB")


async def test_exit_status_and_streams(sbx: corral.AsyncSandbox) -> None:
    r = await sbx.commands.run("echo out; echo err >&2; exit 7")
    assert (r.exit_code, r.stdout, r.stderr, r.ok, r.truncated) == (
        7,
        "out\n",
        "err\n",
        False,
        False,
    )
    assert r.duration > 0 and r.pid > 1


async def test_argv_list_runs_without_a_shell(sbx: corral.AsyncSandbox) -> None:
    r = await sbx.commands.run(["python3", "-c", "import sys; print(sys.argv[1])", "$HOME;x"])
    assert r.stdout == "$HOME;x\n"


async def test_cwd_env_user_stdin(sbx: corral.AsyncSandbox) -> None:
    assert (await sbx.commands.run("pwd", cwd="/tmp")).stdout == "/tmp\n"
    assert (await sbx.commands.run("echo $A", env={"A": "b"})).stdout == "b\n"
    r = await sbx.commands.run("id -u; echo $HOME", user="nobody")
    assert r.stdout.split() == ["65534", "/nonexistent"]
    assert (await sbx.commands.run("id -u; id -g", user="1234:99")).stdout.split() == ["1234", "99"]
    r = await sbx.commands.run("wc -c", stdin=b"x" * 300_000)
    assert r.stdout.strip() == "300000"
    assert (await sbx.commands.run("cat", stdin="héllo")).stdout == "héllo"


async def test_a_user_has_the_groups_the_images_etc_group_gives_it(
    sbx: corral.AsyncSandbox,
) -> None:
    """As login and runc's exec: the primary group, then every group whose
    member list names the user. A line naming a gid the sandbox's user
    namespace does not map (70000), or a malformed one, costs that group
    only, not the command; a gid past 32 bits never wraps round to root's."""
    await sbx.commands.run(
        "printf '%s\\n' 'extra:x:4242:bob,nobody' 'broken line' 'far:x:70000:nobody' "
        "'bad:x:12a:nobody' 'more:x:4343:nobody' 'again:x:4242:nobody' 'none:x:4444:' "
        "'prefix:x:4545:nobodyx' 'wrap:x:4294967296:nobody' >> /etc/group",
        user="root",
    )
    assert (await sbx.commands.run("id -G", user="nobody")).stdout.split() == [
        "65534", "4242", "4343"
    ]  # fmt: skip
    # By uid the same user; a group given (uid:gid) is the only one, as in runc.
    assert (await sbx.commands.run("id -G", user="65534")).stdout.split() == [
        "65534", "4242", "4343"
    ]  # fmt: skip
    assert (await sbx.commands.run("id -G", user="65534:99")).stdout.split() == ["99"]
    # A uid the image does not name has its own group only.
    assert (await sbx.commands.run("id -G", user="1234")).stdout.split() == ["1234"]
    # The group's files are the user's to read.
    r = await sbx.commands.run(
        "install -d -m 0770 -g 4343 /srv/team && echo hi > /srv/team/f && "
        "chgrp 4343 /srv/team/f && chmod 0640 /srv/team/f",
        user="root",
    )
    assert r.exit_code == 0, r
    assert (await sbx.commands.run("cat /srv/team/f", user="nobody")).stdout == "hi\n"
    assert (await sbx.commands.run("cat /srv/team/f", user="1234")).exit_code == 1


async def test_dev_shm_serves_any_user_without_a_superblock_of_its_own(
    sbx: corral.AsyncSandbox,
) -> None:
    # POSIX semaphores and shared memory live in /dev/shm (multiprocessing's
    # locks); it is a sticky world-writable directory of /dev's tmpfs, since
    # a superblock per sandbox costs every memory cgroup on the host a slot.
    script = (
        "import multiprocessing.shared_memory as s, multiprocessing as m; "
        "m.Lock().acquire(); a = s.SharedMemory(create=True, size=4096); a.buf[0] = 7; "
        "b = s.SharedMemory(name=a.name); print(b.buf[0]); b.close(); a.close(); a.unlink()"
    )
    r = await sbx.commands.run(["python3", "-c", script], user="nobody")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "7\n", "")
    r = await sbx.commands.run("stat -c '%a %d' /dev/shm; stat -c '%d' /dev")
    mode, dev_shm, dev = r.stdout.split()
    assert (mode, dev_shm) == ("1777", dev)


async def test_a_command_that_ignores_its_stdin_still_reports(sbx: corral.AsyncSandbox) -> None:
    # The command exits while its input is still being sent: the rest is
    # dropped, and the exit status arrives all the same.
    for _ in range(3):
        r = await sbx.commands.run("echo early; exit 3", stdin=b"x" * (16 << 20))
        assert (r.exit_code, r.stdout) == (3, "early\n")


async def test_bad_cwd_user_and_program_are_invalid_arguments(sbx: corral.AsyncSandbox) -> None:
    with pytest.raises(corral.InvalidArgument) as exc:
        await sbx.commands.run("true", cwd="/does/not/exist")
    assert exc.value.field == "cwd"
    for user in ("nosuchuser", "4294967296", "4294967295", "0:4294967296"):
        with pytest.raises(corral.InvalidArgument) as exc:
            await sbx.commands.run("true", user=user)  # no such user; never a wrap to 0
        assert exc.value.field == "user", user
    with pytest.raises(corral.InvalidArgument) as exc:
        await sbx.commands.run(["/no/such/program"])
    assert exc.value.field == "cmd"
    assert (await sbx.commands.run("no-such-program")).exit_code == 127


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["/etc/passwd"], {}, "Permission denied"),  # a file, not executable
        (["/tmp"], {}, "Permission denied"),  # a directory
        (["sh"], {"PATH": "/nowhere:/also/nowhere"}, "No such file"),
        (["ls"], {"PATH": "/tmp/noexec:/bin"}, None),  # the first runnable one
    ],
)
async def test_the_program_is_found_before_the_command_starts(
    sbx: corral.AsyncSandbox, argv: list[str], env: dict[str, str], message: str | None
) -> None:
    """The exec server finds the program (as execvp would, under the
    command's PATH) before it answers "started", so the command cannot run
    before that answer; what it cannot find is still a bad `cmd`."""
    await sbx.commands.run("mkdir -p /tmp/noexec && touch /tmp/noexec/ls")
    if message is None:
        assert (await sbx.commands.run(argv, env=env)).exit_code == 0
        return
    with pytest.raises(corral.InvalidArgument) as exc:
        await sbx.commands.run(argv, env=env)
    assert exc.value.field == "cmd" and message in str(exc.value), exc.value


async def test_a_program_whose_interpreter_is_missing_exits_127(sbx: corral.AsyncSandbox) -> None:
    """Found and executable, but its #! names no interpreter: execve fails
    after "started", so it is reported as a shell would, exit 127."""
    await sbx.files.write("/tmp/bad.sh", "#!/no/such/interpreter\necho hi\n")
    await sbx.commands.run("chmod +x /tmp/bad.sh")
    r = await sbx.commands.run(["/tmp/bad.sh"])
    assert r.exit_code == 127 and "executing /tmp/bad.sh" in r.stderr, r


async def test_output_streams_to_callbacks_as_it_comes(sbx: corral.AsyncSandbox) -> None:
    seen: list[tuple[float, str]] = []
    t0 = time.monotonic()

    async def on_out(text: str) -> None:
        seen.append((time.monotonic() - t0, text))

    r = await sbx.commands.run("for i in 1 2 3; do echo $i; sleep 0.3; done", on_stdout=on_out)
    assert "".join(t for _, t in seen) == r.stdout == "1\n2\n3\n"
    assert seen[0][0] < seen[-1][0] - 0.4  # the first line came before the end


async def test_timeout_kills_the_whole_tree(sbx: corral.AsyncSandbox) -> None:
    # A grandchild escapes the process group with setsid; it must die too.
    cmd = "setsid sleep 1000 & sleep 1000 & echo started; sleep 1000"
    t0 = time.monotonic()
    with pytest.raises(corral.CommandTimeout) as exc:
        await sbx.commands.run(cmd, timeout=1)
    assert isinstance(exc.value, TimeoutError)
    assert time.monotonic() - t0 < 5
    assert exc.value.result.stdout == "started\n"  # type: ignore[attr-defined]
    await asyncio.sleep(0.2)
    ps = await sbx.commands.run("ps -eo comm= 2>/dev/null || ls /proc | grep -c '^[0-9]'")
    assert "sleep" not in ps.stdout


async def test_a_command_that_stops_its_own_handler_still_times_out(
    embedded: corral.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler that ends a command at its timeout runs as the command's
    user, so the command can stop it (kill -STOP -1) and run on. Past the
    timeout and a grace the agent has init kill it: a timeout like any
    other, not a failed sandbox, and the next command runs."""
    monkeypatch.setattr(sessions, "EXEC_GRACE", 2.0)
    sbx = await embedded.sandboxes.create(image=IMAGE, memory="256MiB")
    t0 = time.monotonic()
    with pytest.raises(corral.CommandTimeout):
        await sbx.commands.run("kill -STOP -1; echo stopped; sleep 60", timeout=1)
    assert time.monotonic() - t0 < 15
    assert (await sbx.refresh()).state.value == "running"
    assert (await sbx.commands.run("echo next")).stdout == "next\n"
    ps = await sbx.commands.run("ps -eo comm= 2>/dev/null || true")
    assert "sleep" not in ps.stdout, ps.stdout


async def test_output_is_capped_and_counted(sbx: corral.AsyncSandbox) -> None:
    r = await sbx.commands.run("head -c 5000000 /dev/zero | tr '\\0' a; echo done >&2", timeout=30)
    assert r.truncated
    assert len(r.stdout) == 1024 * 1024 and r.stdout_bytes == 5_000_000
    assert r.stderr == "done\n"
    r = await sbx.commands.run("yes | head -c 100000", stdout_limit=10)
    assert r.stdout == "y\ny\ny\ny\ny\n" and r.stdout_bytes == 100_000


async def test_background_command(sbx: corral.AsyncSandbox) -> None:
    lines: list[str] = []
    h = await sbx.commands.start(
        "for i in $(seq 5); do echo $i; sleep 0.1; done; exit 3", on_stdout=lines.append
    )
    assert h.pid > 1
    r = await h.wait()
    assert r.exit_code == 3 and r.stdout.split() == ["1", "2", "3", "4", "5"]
    assert "".join(lines) == r.stdout


async def test_kill_a_background_command_and_its_children(sbx: corral.AsyncSandbox) -> None:
    h = await sbx.commands.start("sleep 1000 & sleep 1000")
    with pytest.raises(TimeoutError):
        await h.wait(timeout=0.3)  # bounds the wait only
    await h.kill()
    r = await h.wait()
    assert r.signal == 9
    await asyncio.sleep(0.2)
    assert "sleep" not in (await sbx.commands.run("ps -eo comm=")).stdout


async def test_kill_by_pid_from_a_new_handle(
    client: corral.AsyncClient, sbx: corral.AsyncSandbox
) -> None:
    h = await sbx.commands.start("sleep 1000")
    again = await client.sandboxes.get(sbx.id)
    await again.commands.kill(h.pid, 15)
    assert (await h.wait()).signal == 15
    with pytest.raises(corral.CommandNotFound):
        await again.commands.kill(99999)


async def test_many_commands_at_once(sbx: corral.AsyncSandbox) -> None:
    results = await asyncio.gather(*(sbx.commands.run(f"echo {i}") for i in range(50)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(50)]


async def test_a_background_daemon_survives_its_command(sbx: corral.AsyncSandbox) -> None:
    await sbx.commands.run("nohup sleep 1000 >/dev/null 2>&1 &")
    # (the image has no ps: read the process table directly)
    r = await sbx.commands.run("sleep 0.5; cat /proc/[0-9]*/comm")
    assert "sleep" in r.stdout.split()
