"""The stock `e2b` SDK from PyPI, unmodified, against `corral serve`: the
control API and envd through every call docs/e2b.md maps, and the bad
input E2B's clients can send. (E2B's own test suite: `make e2b-conformance`.)"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
import struct
from collections.abc import Iterator

import httpx
import pytest

import corral
from corral.node import states
from corral.node.store import SandboxRecord

from ..framework import Node, Server
from ..framework.images import require_image

e2b = pytest.importorskip("e2b", reason="the e2b package (a dev dependency) is not installed")

KEY = "e2b_" + "0" * 40


@pytest.fixture
def e2b_env(server: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    require_image("e2b-user:bookworm")
    require_image("e2b-tools:bookworm")
    url = server.tcp_url
    for k, v in {
        "E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": KEY,
        "E2B_DOMAIN": "corral.local",
    }.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    yield url


async def test_the_base_template_has_e2b_bases_tools(e2b_env: str) -> None:
    """What agents written for E2B run on its base template: pip that
    installs (no PEP 668 refusal), Node.js and npm, git, curl, pgrep."""
    s = await e2b.AsyncSandbox.create("base", timeout=120)
    try:
        r = await s.commands.run(
            "node -e 'console.log(6 * 7)' && npm --version >/dev/null && git --version"
            " && curl --version | head -1 && pgrep -x bash >/dev/null && echo pgrep-ok"
            " && python3 -m venv /tmp/v && echo venv-ok && python -c 'print(\"python-ok\")'"
        )
        out = r.stdout.splitlines()
        assert out[0] == "42" and out[1].startswith("git version") and out[2].startswith("curl")
        assert out[3:] == ["pgrep-ok", "venv-ok", "python-ok"], r.stdout
        # A local package installs with pip as the user, without a venv.
        await s.files.write("/home/user/pkg/setup.py", "from setuptools import setup\n"
                            "setup(name='corralpkg', version='1', py_modules=['corralmod'])\n")  # fmt: skip
        await s.files.write("/home/user/pkg/corralmod.py", "X = 42\n")
        r = await s.commands.run("pip install --no-build-isolation --no-index ./pkg -q 2>&1; "
                                 "python3 -c 'import corralmod; print(corralmod.X)'")  # fmt: skip
        assert r.stdout.strip().splitlines()[-1] == "42", r.stdout
    finally:
        await s.kill()


async def test_a_sandbox_lives_and_dies_through_e2bs_control_api(e2b_env: str) -> None:
    s = await e2b.AsyncSandbox.create("base", timeout=120, metadata={"job": "e2b-life"},
                                      envs={"FROM_CREATE": "yes"})  # fmt: skip
    try:
        info = await s.get_info()
        assert info.sandbox_id == s.sandbox_id and info.template_id == "base"
        assert info.metadata == {"job": "e2b-life"}
        assert await s.is_running()
        listed = e2b.AsyncSandbox.list(query=e2b.SandboxQuery(metadata={"job": "e2b-life"}))
        assert [x.sandbox_id for x in await listed.next_items()] == [s.sandbox_id]
        await s.set_timeout(60)
        assert (await s.get_info()).end_at.timestamp() < info.end_at.timestamp()
        assert (await s.commands.run("echo $FROM_CREATE")).stdout == "yes\n"
        # Paused, it is not running; connect brings it back where it was.
        await s.files.write("/tmp/kept", "across the pause")
        assert await s.pause()
        assert not await s.is_running()
        assert (await s.get_info()).state.value == "paused"
        back = await e2b.AsyncSandbox.connect(s.sandbox_id)
        assert await back.is_running()
        assert await back.files.read("/tmp/kept") == "across the pause"
    finally:
        assert await s.kill()
    assert not await s.is_running()
    assert not await e2b.AsyncSandbox.kill(s.sandbox_id)  # already gone: False, as E2B
    with pytest.raises(e2b.NotFoundException):
        await e2b.AsyncSandbox.connect(s.sandbox_id)


async def test_commands_run_as_e2bs_user_in_its_home(e2b_env: str) -> None:
    s = await e2b.AsyncSandbox.create("base", timeout=120)
    try:
        r = await s.commands.run("whoami; pwd; echo $FOO", envs={"FOO": "bar"})
        assert r.stdout == "user\n/home/user\nbar\n" and r.exit_code == 0
        assert (await s.commands.run("whoami", user="root")).stdout == "root\n"
        # "localhost" resolves (a server the agent starts is reached by name).
        look = "python3 -c 'import socket; print(socket.gethostbyname(\"localhost\"))'"
        assert (await s.commands.run(look)).stdout == "127.0.0.1\n"
        with pytest.raises(e2b.CommandExitException) as e:
            await s.commands.run("echo out; echo err >&2; exit 3")
        assert (e.value.exit_code, e.value.stdout, e.value.stderr) == (3, "out\n", "err\n")
        seen: list[str] = []
        await s.commands.run("for i in 1 2 3; do echo $i; done", on_stdout=seen.append)
        assert "".join(seen) == "1\n2\n3\n"
        with pytest.raises(e2b.TimeoutException):
            await s.commands.run("sleep 10", timeout=1)
        # Background: listed, reachable again by pid, killed.
        bg = await s.commands.run("sleep 60", background=True)
        assert bg.pid in [p.pid for p in await s.commands.list()]
        again = await s.commands.connect(bg.pid)
        assert again.pid == bg.pid
        assert await s.commands.kill(bg.pid)
        assert not await s.commands.kill(999999)
        with pytest.raises(e2b.CommandExitException):
            await s.commands.run(f"kill -0 {bg.pid}")
        # stdin, sent while it runs, then closed.
        cat = await s.commands.run("cat", background=True, stdin=True)
        await s.commands.send_stdin(cat.pid, "hello over stdin")
        await s.commands.close_stdin(cat.pid)
        assert (await cat.wait()).stdout == "hello over stdin"
    finally:
        await s.kill()


async def test_a_terminal_through_envd(e2b_env: str) -> None:
    """A PTY: a shell on a terminal of the asked size, fed keystrokes,
    resized, killed."""
    s = await e2b.AsyncSandbox.create("base", timeout=120)
    try:
        out = bytearray()
        term = await s.pty.create(e2b.PtySize(rows=24, cols=80), on_data=out.extend)
        await s.pty.send_stdin(term.pid, b"stty size; tty; echo marker-$((6*7))\n")
        for _ in range(100):
            if b"marker-42" in out:
                break
            await asyncio.sleep(0.05)
        assert b"24 80" in out and b"/dev/pts/" in out and b"marker-42" in out, bytes(out)
        await s.pty.resize(term.pid, e2b.PtySize(rows=40, cols=120))
        await s.pty.send_stdin(term.pid, b"stty size\n")
        for _ in range(100):
            if b"40 120" in out:
                break
            await asyncio.sleep(0.05)
        assert b"40 120" in out, bytes(out)
        assert await s.pty.kill(term.pid)
    finally:
        await s.kill()


async def test_sudo_in_a_terminal_has_a_terminal_of_its_own(e2b_env: str) -> None:
    """As sudo's use_pty: in a terminal's foreground, the root command gets
    a pty of its own as its controlling terminal (its own /dev/tty, job
    control, the size), keystrokes and a typed Ctrl-C reach it, a resize
    reaches it, and the caller's terminal is given back as it was."""
    s = await e2b.AsyncSandbox.create("base", timeout=120)
    try:
        out = bytearray()
        term = await s.pty.create(e2b.PtySize(rows=24, cols=80), on_data=out.extend)

        async def typed(keys: bytes, until: bytes) -> str:
            mark = len(out)
            await s.pty.send_stdin(term.pid, keys)
            for _ in range(200):
                if until in out[mark:]:
                    break
                await asyncio.sleep(0.05)
            seen = bytes(out[mark:])
            assert until in seen, seen
            return seen.decode(errors="replace")

        ttys = await typed(b"sudo tty; tty; echo done-$((1+1))\n", b"done-2")
        assert len(set(re.findall(r"/dev/pts/\d+", ttys))) == 2, ttys
        assert "24 80" in await typed(b"sudo stty size; echo done-$((2+1))\n", b"done-3")
        await typed(b"sudo sh -c 'read x; echo got-$x'\n", b"sudo sh")
        await typed(b"hello\n", b"got-hello")
        await typed(b"sudo sh -c 'echo sleep-$((3*3)); exec sleep 100'\n", b"sleep-9")
        await s.pty.send_stdin(term.pid, b"\x03")  # Ctrl-C, through the pty's line discipline
        await typed(b"echo rc-$?\n", b"rc-130")
        await typed(
            b'sudo sh -c \'trap "stty size" WINCH; echo wait-$((4*4)); '
            b"while :; do sleep 0.1; done'\n",
            b"wait-16",
        )
        mark = len(out)
        await s.pty.resize(term.pid, e2b.PtySize(rows=33, cols=99))
        for _ in range(200):
            if b"33 99" in out[mark:]:
                break
            await asyncio.sleep(0.05)
        assert b"33 99" in out[mark:], bytes(out[mark:])
        await s.pty.send_stdin(term.pid, b"\x03")
        login = await typed(b"sudo -i\n", b"root")  # its prompt
        login += await typed(b"echo flags-$-; tty; exit\n", b"logout")
        assert "no job control" not in login and re.search(r"flags-\w*m", login), login
        # All of a command's output, however fast it ends.
        many = await typed(
            b"sudo sh -c 'head -c 100000 /dev/zero | tr \"\\\\0\" x'; echo done-$((3+4))\n",
            b"done-7",
        )
        assert many.count("x") >= 100_000, many[-300:]
        # Given back: the caller's line discipline as before.
        assert "-icanon" not in await typed(b"sudo true; stty -a; echo done-$((5+1))\n", b"done-6")
        assert await s.pty.kill(term.pid)
    finally:
        await s.kill()


async def test_files_through_envd(e2b_env: str) -> None:
    s = await e2b.AsyncSandbox.create("base", timeout=120)
    try:
        info = await s.files.write("notes/a.txt", "first")
        assert info.path == "/home/user/notes/a.txt"
        assert await s.files.read("notes/a.txt") == "first"
        assert await s.files.read("/home/user/notes/a.txt", format="bytes") == b"first"
        entry = await s.files.get_info("notes/a.txt")
        assert (entry.size, entry.mode, entry.permissions) == (5, 0o644, "-rw-r--r--")
        assert (entry.owner, entry.group) == ("user", "user")
        await s.files.write_files([{"path": "notes/b.txt", "data": b"\x00\x01"},
                                   {"path": "notes/c.txt", "data": "c"}])  # fmt: skip
        names = [x.name for x in await s.files.list("notes")]
        assert names == ["a.txt", "b.txt", "c.txt"]
        # As envd (root): directories the user could not make are made for it.
        assert await s.files.make_dir("/workspace/deep")
        assert (await s.files.get_info("/workspace")).owner == "user"
        up = await s.files.write("/outside/made/f.txt", "f")
        assert (await s.files.get_info("/outside/made")).owner == "user" and up.path
        # A client's "unbounded" deadline (24 h: openai-agents' default) is its own.
        long = await s.commands.run("echo long", timeout=86400)
        assert long.stdout == "long\n"
        assert await s.files.make_dir("notes/sub")
        assert not await s.files.make_dir("notes/sub")  # exists: False, as E2B
        moved = await s.files.rename("notes/c.txt", "notes/sub/c.txt")
        assert moved.path == "/home/user/notes/sub/c.txt"
        assert [x.path for x in await s.files.list("notes", depth=2)][-1] == moved.path
        assert await s.files.exists("notes/sub/c.txt")
        await s.files.remove("notes/sub")
        assert not await s.files.exists("notes/sub/c.txt")
        await s.files.remove("notes/never-was")  # as envd: no error
        with pytest.raises(e2b.FileNotFoundException):
            await s.files.read("notes/missing")
        await s.commands.run("ln -s a.txt notes/link")
        link = await s.files.get_info("notes/link")
        assert link.symlink_target == "/home/user/notes/a.txt"
        # Metadata: the file's user.e2b.* extended attributes, as envd keeps them.
        tagged = await s.files.write("notes/m.txt", "m", metadata={"author": "corral"})
        assert tagged.metadata == {"author": "corral"}
        assert (await s.files.get_info("notes/m.txt")).metadata == {"author": "corral"}
        await s.files.write("notes/m.txt", "again")  # a rewrite without: none left
        assert (await s.files.get_info("notes/m.txt")).metadata is None
        await s.commands.run("python3 -c \"import os; os.setxattr('notes/m.txt', "
                             "'user.e2b.set', b'inside')\"")  # fmt: skip
        assert (await s.files.get_info("notes/m.txt")).metadata == {"set": "inside"}
        # A watcher sees what changes after it starts (inotify in the sandbox).
        seen: list[tuple[str, str]] = []
        w = await s.files.watch_dir("notes", on_event=lambda ev: seen.append((ev.type.value, ev.name)),
                                    recursive=True)  # fmt: skip
        await s.files.write("notes/deep/w.txt", "watched")
        await s.files.remove("notes/a.txt")
        for _ in range(50):
            if ("remove", "a.txt") in seen:
                break
            await asyncio.sleep(0.1)
        await w.stop()
        assert ("create", "deep") in seen and ("write", "deep/w.txt") in seen, seen
        assert ("remove", "a.txt") in seen, seen
    finally:
        await s.kill()


async def test_a_sandboxs_own_server_is_reached_through_corral(e2b_env: str) -> None:
    """Another E2b-Sandbox-Port, or the host Sandbox.get_host() names, is a
    server inside the sandbox (which has no network of its own)."""
    s = await e2b.AsyncSandbox.create("base", timeout=120)
    try:
        await s.files.write("/tmp/site/hello.txt", "served from inside")
        await s.commands.run("python3 -m http.server 8000 --directory /tmp/site", background=True)
        await s.commands.run("for i in $(seq 50); do (echo > /dev/tcp/127.0.0.1/8000) 2>/dev/null "
                             "&& break; sleep 0.1; done")  # fmt: skip
        token = s._envd_access_token
        by_port = {"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": "8000",
                   "X-Access-Token": token}  # fmt: skip
        host = s.get_host(8000)
        async with httpx.AsyncClient(base_url=e2b_env, timeout=30) as h:
            r = await h.get("/hello.txt", headers=by_port)
            assert (r.status_code, r.text) == (200, "served from inside")
            r = await h.get("/hello.txt", headers={"Host": host, "X-Access-Token": token})
            assert (r.status_code, r.text) == (200, "served from inside")
            r = await h.get("/missing", headers=by_port)
            assert r.status_code == 404  # the sandbox's server said so
            r = await h.get("/hello.txt", headers={**by_port, "X-Access-Token": "forged"})
            assert r.status_code == 401
            # The traffic token (what a browser is given for a port) opens
            # the ports, and nothing of envd: not the envd token.
            traffic = s.traffic_access_token
            assert traffic and traffic != token
            r = await h.get("/hello.txt", headers={**by_port, "X-Access-Token": "",
                                                    "E2B-Traffic-Access-Token": traffic})  # fmt: skip
            assert (r.status_code, r.text) == (200, "served from inside")
            stat = {"E2b-Sandbox-Id": s.sandbox_id, "X-Access-Token": traffic}
            r = await h.post("/filesystem.Filesystem/Stat", json={"path": "/"}, headers=stat)
            assert r.status_code == 401 and r.json()["code"] == "unauthenticated", r.text
            r = await h.get("/", headers={**by_port, "E2b-Sandbox-Port": "8001"})
            assert r.status_code == 502  # nothing listens there
            r = await h.get("/", headers={**by_port, "E2b-Sandbox-Port": "99999"})
            assert r.status_code == 400
    finally:
        await s.kill()


def _envelope(doc: object) -> bytes:
    data = json.dumps(doc).encode()
    return struct.pack(">BI", 0, len(data)) + data


async def test_envd_refuses_bad_requests_with_connects_own_errors(e2b_env: str) -> None:
    s = await e2b.AsyncSandbox.create("base", timeout=120)
    other = await e2b.AsyncSandbox.create("base", timeout=120)
    try:
        token = s._envd_access_token
        head = {"E2b-Sandbox-Id": s.sandbox_id, "E2b-Sandbox-Port": "49983",
                "X-Access-Token": token}  # fmt: skip
        rpc = "/filesystem.Filesystem/Stat"
        async with httpx.AsyncClient(base_url=e2b_env, timeout=30) as h:
            ok = await h.post(rpc, json={"path": "/"}, headers=head)
            assert ok.status_code == 200 and ok.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"
            cases = [
                # (headers, path, body, content type, status, connect code)
                ({**head, "X-Access-Token": "forged"}, rpc, b'{"path":"/"}', "application/json",
                 401, "unauthenticated"),
                ({**head, "X-Access-Token": other._envd_access_token}, rpc, b'{"path":"/"}',
                 "application/json", 401, "unauthenticated"),  # another sandbox's token
                # No sandbox: the same answer as another's (nothing is said of it).
                ({**head, "E2b-Sandbox-Id": "nosuch-0000000000000000"}, rpc, b"{}",
                 "application/json", 401, "unauthenticated"),
                (head, rpc, b"{not json", "application/json", 400, "invalid_argument"),
                (head, rpc, b'{"path":"/"}', "text/plain", 501, "unimplemented"),
                (head, "/filesystem.Filesystem/Chmod", b"{}", "application/json", 501,
                 "unimplemented"),
                (head, rpc, b'{"path":"/nope"}', "application/json", 404, "not_found"),
            ]  # fmt: skip
            for headers, path, body, ctype, status, code in cases:
                r = await h.post(path, content=body, headers={**headers, "Content-Type": ctype})
                assert (r.status_code, r.json()["code"]) == (status, code), (path, body, r.text)
            # A stream with a malformed envelope: HTTP 200, the error in the end message.
            stream_head = {**head, "Content-Type": "application/connect+json"}
            for body in (b"\x00\x00\x00", struct.pack(">BI", 0, 99) + b"{}",
                         struct.pack(">BI", 1, 2) + b"{}"):  # fmt: skip
                r = await h.post("/process.Process/Start", content=body, headers=stream_head)
                assert r.status_code == 200 and r.content[0] == 0x02, r.content
                assert json.loads(r.content[5:])["error"]["code"] in (
                    "invalid_argument",
                    "unimplemented",
                )
            r = await h.post("/process.Process/Start", headers=stream_head,
                             content=_envelope({"process": {"cmd": ""}}))  # fmt: skip
            assert json.loads(r.content[5:])["error"]["code"] == "invalid_argument"
            # Uploads: gzip, octet-stream, and a corrupt gzip.
            up = {**head, "Content-Type": "application/octet-stream"}
            r = await h.post("/files", params={"path": "z.txt"}, content=gzip.compress(b"zz"),
                             headers={**up, "Content-Encoding": "gzip"})  # fmt: skip
            assert r.status_code == 200 and r.json()[0]["path"] == "/home/user/z.txt"
            r = await h.post("/files", params={"path": "y.txt"}, content=b"not gzip",
                             headers={**up, "Content-Encoding": "gzip"})  # fmt: skip
            assert r.status_code == 400
            assert (await s.files.read("z.txt")) == "zz"
            assert not await s.files.exists("y.txt")
            r = await h.get("/health", headers={**head, "E2b-Sandbox-Id": "nosuch"})
            assert r.status_code == 502
        # The control API: a template that does not exist, a key that is wrong.
        with pytest.raises(e2b.SandboxException, match="not found"):
            await e2b.AsyncSandbox.create("no-such-template", timeout=30)
        async with httpx.AsyncClient(base_url=e2b_env, timeout=30) as h:
            bad = await h.post("/sandboxes", json={"templateID": "base", "timeout": -1},
                               headers={"X-API-KEY": KEY})  # fmt: skip
            assert bad.status_code == 400 and bad.json()["code"] == 400
            bad = await h.post(
                "/sandboxes",
                json={"templateID": "base", "metadata": {"corral.project": "x"}},
                headers={"X-API-KEY": KEY},
            )
            assert bad.status_code == 400
            page = await h.get("/v2/sandboxes", params={"nextToken": "garbage"},
                               headers={"X-API-KEY": KEY})  # fmt: skip
            assert page.status_code == 400
    finally:
        await asyncio.gather(s.kill(), other.kill())


async def test_a_killed_sandboxs_streams_are_dropped(e2b_env: str, node: Node) -> None:
    s = await e2b.AsyncSandbox.create("base", timeout=120)
    bg = await s.commands.run("sleep 60", background=True)
    await s.kill()
    with pytest.raises(Exception):  # noqa: B017 (the SDK's transport error, whichever)
        async with asyncio.timeout(20):
            await bg.wait()
    assert node.resources(s.sandbox_id) == []


async def test_network_rules_and_metrics_map_to_corrals(e2b_env: str, server: Server) -> None:
    """allowOut is the sandbox's whole policy (no network without one);
    PUT /network replaces it; metrics are read from the sandbox's cgroup."""
    s = await e2b.AsyncSandbox.create(
        "base", timeout=120, network={"allow_out": ["10.9.8.7", "pypi.org"], "deny_out": []}
    )
    closed = await e2b.AsyncSandbox.create("base", timeout=120)
    try:
        async with corral.AsyncClient(server.url) as c:
            info = await c.sandboxes.get(s.sandbox_id)
            assert info.info.network is not None
            assert info.info.network.cidrs == ["10.9.8.7/32"]
            assert info.info.network.domains == ["pypi.org"] and info.info.network.ports == []
            assert (await c.sandboxes.get(closed.sandbox_id)).info.network is None
            await s.update_network({"allow_out": ["10.1.0.0/16"]})
            after = (await c.sandboxes.get(s.sandbox_id)).info.network
            assert after is not None and after.cidrs == ["10.1.0.0/16"] and after.domains == []
        await s.commands.run("python3 -c 'x = bytearray(30 << 20); sum(range(3000000))'")
        (m,) = await s.get_metrics()
        assert m.cpu_count == 1 and 0 < m.cpu_used_pct <= 100
        assert 0 < m.mem_used < m.mem_total == 512 << 20
        assert m.disk_total > 0
        async with httpx.AsyncClient(base_url=e2b_env, headers={"X-API-KEY": KEY}) as h:
            bad = await h.post("/sandboxes", json={
                "templateID": "base", "network": {"rules": {"x.example": {}}}})  # fmt: skip
            assert bad.status_code == 400 and "network.rules" in bad.json()["message"]
            bad = await h.get(f"/sandboxes/{s.sandbox_id}/metrics", params={"start": "soon"})
            assert bad.status_code == 400 and "start" in bad.json()["message"]
    finally:
        await s.kill()
        await closed.kill()


async def test_http2_cleartext_beside_http11(e2b_env: str) -> None:
    """A client with HTTP/2 prior knowledge (Connect's and gRPC's over plain
    TCP) gets HTTP/2 on the same port: the control API, a streamed Connect
    call and Corral's own API; an HTTP/1.1 client still gets HTTP/1.1."""
    async with httpx.AsyncClient(http1=False, http2=True, base_url=e2b_env) as h2:
        made = await h2.post("/sandboxes", headers={"X-API-KEY": KEY}, json={"templateID": "base"})
        assert (made.http_version, made.status_code) == ("HTTP/2", 201)
        sid, token = made.json()["sandboxID"], made.json()["envdAccessToken"]
        body = json.dumps({"process": {"cmd": "/bin/bash", "args": ["-c", "echo over-h2"]}})
        frame = struct.pack(">BI", 0, len(body)) + body.encode()
        async with h2.stream(
            "POST", "/process.Process/Start", content=frame,
            headers={"E2b-Sandbox-Id": sid, "X-Access-Token": token,
                     "Content-Type": "application/connect+json"},
        ) as r:  # fmt: skip
            assert (r.http_version, r.status_code) == ("HTTP/2", 200)
            raw = b"".join([x async for x in r.aiter_bytes()])
        assert b'"stdout":"b3Zlci1oMgo="' in raw  # "over-h2\n"
        assert b'"end":{"exitCode":0' in raw
        own = await h2.get(f"/v1/sandboxes/{sid}")
        assert own.http_version == "HTTP/2" and own.json()["id"] == sid
        gone = await h2.delete(f"/sandboxes/{sid}", headers={"X-API-KEY": KEY})
        assert gone.status_code == 204
    async with httpx.AsyncClient(base_url=e2b_env) as h1:
        assert (await h1.get("/healthz")).http_version == "HTTP/1.1"


async def test_a_snapshot_is_a_template_of_the_sandboxs_files(e2b_env: str, node: Node) -> None:
    s = await e2b.AsyncSandbox.create("base", timeout=120)
    try:
        await s.files.write("/home/user/state.txt", "kept in the snapshot")
        snap = await s.create_snapshot(name="e2b-snap_test")  # E2B's names may hold '_'
        assert snap.snapshot_id == "snapshots:e2b-snap_test"
        await s.files.write("/home/user/state.txt", "after the snapshot")  # not in it
        listed = s.list_snapshots()
        assert [x.snapshot_id for x in await listed.next_items()] == [snap.snapshot_id]
    finally:
        await s.kill()
    again = await e2b.AsyncSandbox.create(snap.snapshot_id, timeout=120)
    try:
        assert await again.files.read("/home/user/state.txt") == "kept in the snapshot"
        assert (await again.commands.run("whoami")).stdout == "user\n"
        with pytest.raises(e2b.SandboxException):  # in use: not deleted under it
            await e2b.AsyncSandbox.delete_snapshot(snap.snapshot_id)
    finally:
        await again.kill()
    assert await e2b.AsyncSandbox.delete_snapshot(snap.snapshot_id)
    assert not await e2b.AsyncSandbox.delete_snapshot(snap.snapshot_id)  # gone: False
    with pytest.raises(e2b.SandboxException, match="not found"):
        await e2b.AsyncSandbox.create(snap.snapshot_id, timeout=60)
    async with httpx.AsyncClient(base_url=e2b_env, headers={"X-API-KEY": KEY}) as h:
        bad = await h.post(f"/sandboxes/{again.sandbox_id}/snapshots", json={"name": "x"})
        assert bad.status_code == 404  # killed: no snapshot of it
        other = await e2b.AsyncSandbox.create("base", timeout=60)
        try:
            bad = await h.post(
                f"/sandboxes/{other.sandbox_id}/snapshots", json={"name": "Bad Name"}
            )
            assert bad.status_code == 400 and "name" in bad.json()["message"]
            # An image (not a snapshot) holds the name: a snapshot may not take it.
            async with node.http_client() as c:
                mine = await c.sandboxes.get(other.sandbox_id)
                taken = await mine.commit("snapshots:taken")
            try:
                bad = await h.post(f"/sandboxes/{other.sandbox_id}/snapshots",
                                   json={"name": "taken"})  # fmt: skip
                assert bad.status_code == 409 and "not a snapshot" in bad.json()["message"]
            finally:
                async with node.http_client() as c:
                    await c.service.delete_layer(taken.digest)
        finally:
            await other.kill()
        bad = await h.get("/snapshots", params={"nextToken": "forged"})
        assert bad.status_code == 400
        # A route E2B has and Corral does not: still E2B's error shape.
        bad = await h.post(f"/sandboxes/{other.sandbox_id}/refreshes")
        assert bad.status_code == 404 and bad.json()["code"] == 404


async def test_auto_pause_pauses_at_the_timeout_and_connect_resumes(
    e2b_env: str, node: Node
) -> None:
    """E2B's lifecycle on_timeout "pause" is Corral's on_expiry: the
    sandbox pauses at its timeout (to disk with keep_memory False), keeps
    its files and processes, and connect() brings it back."""
    s = await e2b.AsyncSandbox.create("base", timeout=2, lifecycle={"on_timeout": "pause"})
    cold = await e2b.AsyncSandbox.create(
        "base", timeout=600, lifecycle={"on_timeout": {"action": "pause", "keep_memory": False}}
    )
    try:
        await s.files.write("/home/user/kept.txt", "kept")
        for _ in range(300):
            if (await s.get_info()).state == e2b.SandboxState.PAUSED:
                break
            await asyncio.sleep(0.1)
        assert (await s.get_info()).state == e2b.SandboxState.PAUSED
        assert not await s.is_running()
        await s.connect(timeout=60)
        assert await s.is_running()
        assert await s.files.read("/home/user/kept.txt") == "kept"
        await cold.set_timeout(0)  # the timeout is now
        for _ in range(300):
            if (await cold.get_info()).state == e2b.SandboxState.PAUSED:
                break
            await asyncio.sleep(0.1)
        async with httpx.AsyncClient(base_url=e2b_env, headers={"X-API-KEY": KEY}) as h:
            got = await h.get(f"/sandboxes/{cold.sandbox_id}")
            assert got.json()["state"] == "paused"
            bad = await h.post("/sandboxes", json={"templateID": "base", "autoPause": "yes"})
            assert bad.status_code == 400 and "autoPause" in bad.json()["message"]
        async with node.http_client() as c:  # E2B's paused is suspending too: until it is done
            for _ in range(300):
                info = (await c.sandboxes.get(cold.sandbox_id)).info
                if info.state == "suspended":
                    break
                await asyncio.sleep(0.1)
            assert (info.state, info.suspended) == ("suspended", "disk")
    finally:
        await s.kill()
        await cold.kill()


async def test_a_signed_url_reads_or_writes_its_one_file_without_a_token(e2b_env: str) -> None:
    """Sandbox.download_url / upload_url: what a browser or curl is given.
    The URL names no sandbox (one endpoint): its signature finds it."""
    s = await e2b.AsyncSandbox.create("base", timeout=120)
    other = await e2b.AsyncSandbox.create("base", timeout=120)
    try:
        await s.files.write("notes.txt", "signed for")
        await other.files.write("notes.txt", "the other sandbox's")
        async with httpx.AsyncClient() as h:  # no key, no token, no sandbox id
            got = await h.get(s.download_url("notes.txt", "user", 60))
            assert (got.status_code, got.text) == (200, "signed for")
            got = await h.get(other.download_url("notes.txt", "user"))
            assert (got.status_code, got.text) == (200, "the other sandbox's")
            put = await h.post(s.upload_url("up.txt", "user"), files={"file": ("up.txt", b"put")})
            assert put.status_code == 200, put.text
            assert await s.files.read("/home/user/up.txt") == "put"
            for url, method, said in (
                (s.download_url("notes.txt", "user", -120), "GET", "signature is already expired"),
                (s.download_url("notes.txt", "user").replace("notes.txt", "up.txt", 1), "GET",
                 "invalid signature"),  # another file
                (s.download_url("notes.txt", "user"), "POST", "invalid signature"),  # a write
                (s.upload_url("up.txt", "root"), "POST", "invalid signature"),  # root's: not given
            ):  # fmt: skip
                if "root" in url:
                    url = url.replace("username=root", "username=user")
                bad = await h.request(
                    method, url, files={"file": ("x", b"x")} if method == "POST" else None
                )
                assert (bad.status_code, bad.json()) == (401, {"code": 401, "message": said}), url
            # Its signature is for one path: a second part, or no path, writes nothing.
            two = [("file", ("a", b"a")), ("file", ("/home/user/.bashrc", b"exit"))]
            bad = await h.post(s.upload_url("up.txt", "user"), files=two)
            assert bad.status_code == 400 and "one 'file' part" in bad.text
            bad = await h.post(s.upload_url("", "user"), files={"file": ("/tmp/x", b"x")})
            assert bad.status_code == 400 and "names its path" in bad.text
            assert await s.files.read("/home/user/.bashrc") != "exit"
            # Basic auth names the user before the query does: not with a signature.
            bad = await h.get(s.download_url("notes.txt", "user"), auth=("root", ""))
            assert bad.status_code == 401 and "Authorization" in bad.json()["message"]
    finally:
        await s.kill()
        await other.kill()


async def test_a_fork_copies_the_running_sandbox_memory_and_all(e2b_env: str) -> None:
    """E2B's fork is Corral's: each copy has the source's files and its
    processes, running on from where they were; the source runs on."""
    s = await e2b.AsyncSandbox.create("base", timeout=120)
    try:
        await s.files.write("/home/user/state.txt", "state before fork")
        # A process of the sandbox's own, detached (a command still attached
        # holds a connection no checkpoint can carry), counting in memory.
        await s.commands.run(
            "setsid sh -c 'n=0; while :; do n=$((n+1)); echo $n > /tmp/count; sleep 0.05; done'"
            " >/dev/null 2>&1 < /dev/null &"
        )
        await asyncio.sleep(0.5)
        before = int(await s.files.read("/tmp/count"))
        forks = await s.fork(count=2, timeout=90)
        copies = [f for f in forks if isinstance(f, e2b.AsyncSandbox)]
        assert len(copies) == 2, forks
        try:
            assert len({c.sandbox_id for c in copies} | {s.sandbox_id}) == 3
            assert await s.is_running()
            for c in copies:
                assert await c.files.read("/home/user/state.txt") == "state before fork"
                await asyncio.sleep(0.3)
                # The counter ran on in the copy: its memory came with it.
                assert int(await c.files.read("/tmp/count")) > before
                info = await c.get_info()
                assert 60 < (info.end_at - info.started_at).total_seconds() <= 120
            await copies[0].files.write("/home/user/state.txt", "modified in fork")
            assert await s.files.read("/home/user/state.txt") == "state before fork"
            assert await copies[1].files.read("/home/user/state.txt") == "state before fork"
        finally:
            for c in copies:
                await c.kill()
        async with httpx.AsyncClient(base_url=e2b_env, headers={"X-API-KEY": KEY}) as h:
            for count in (0, 33, "2", True):
                bad = await h.post(f"/sandboxes/{s.sandbox_id}/fork", json={"count": count})
                assert bad.status_code == 400 and "count" in bad.json()["message"], count
            bad = await h.post(f"/sandboxes/{s.sandbox_id}/fork", json={"timeout": -1})
            assert bad.status_code == 400 and "timeout" in bad.json()["message"]
        running = await s.commands.run("sleep 30", background=True)
        with pytest.raises(e2b.SandboxException, match="command"):  # 409: it is attached
            await s.fork()
        await running.kill()
    finally:
        await s.kill()
    with pytest.raises(e2b.SandboxNotFoundException):
        await s.fork()


async def test_a_sandboxs_logs_are_its_command_log(e2b_env: str) -> None:
    """E2B's logs routes read the command log the platform keeps on the
    host (the sandbox cannot write to it)."""
    s = await e2b.AsyncSandbox.create("base", timeout=120)
    try:
        await s.commands.run("echo visible-in-the-log")
        with pytest.raises(e2b.CommandExitException):
            await s.commands.run("exit 3")
        async with httpx.AsyncClient(base_url=e2b_env, headers={"X-API-KEY": KEY}) as h:
            v1 = (await h.get(f"/sandboxes/{s.sandbox_id}/logs")).json()
            assert any("visible-in-the-log" in x["line"] for x in v1["logs"])
            levels = {e["fields"].get("exit_code"): e["level"] for e in v1["logEntries"]}
            assert levels["0"] == "info" and levels["3"] == "warn"
            warn = (await h.get(f"/v2/sandboxes/{s.sandbox_id}/logs",
                                params={"level": "warn"})).json()["logs"]  # fmt: skip
            assert [e["fields"]["exit_code"] for e in warn] == ["3"]
            found = await h.get(
                f"/v2/sandboxes/{s.sandbox_id}/logs",
                params={"search": "visible-in", "direction": "backward"},
            )
            assert len(found.json()["logs"]) == 1
            for bad in ({"level": "loud"}, {"direction": "sideways"}, {"cursor": "soon"}):
                r = await h.get(f"/v2/sandboxes/{s.sandbox_id}/logs", params=bad)
                assert r.status_code == 400 and next(iter(bad)) in r.json()["message"]
            assert (await h.get("/sandboxes/nosuch-0000000000000000/logs")).status_code == 404
    finally:
        await s.kill()


@pytest.mark.requires_qemu
async def test_envd_serves_a_microvm_as_it_serves_a_container(e2b_env: str) -> None:
    """The template base-microvm: the same E2B calls, on a sandbox with a
    kernel of its own."""
    s = await e2b.AsyncSandbox.create("base-microvm", timeout=300)
    try:
        r = await s.commands.run("whoami; pwd; uname -r; echo $FOO", envs={"FOO": "vm"})
        lines = r.stdout.splitlines()
        assert lines[:2] == ["user", "/home/user"] and lines[3] == "vm"
        assert lines[2] != os.uname().release  # the guest's kernel, not the host's
        await s.files.write("notes/a.txt", "in the guest")
        assert await s.files.read("/home/user/notes/a.txt") == "in the guest"
        assert [e.name for e in await s.files.list("notes")] == ["a.txt"]
        bg = await s.commands.run("sleep 30", background=True)
        assert bg.pid in [p.pid for p in await s.commands.list()]
        assert await s.commands.kill(bg.pid)
    finally:
        await s.kill()


async def test_a_create_whose_client_timed_out_is_closed(e2b_env: str, node: Node) -> None:
    """E2B's create with a client timeout shorter than the create: the
    client gives up, and the sandbox made for it is closed, not kept for
    its TTL. The timeout grows until the client leaves mid-create: on a
    busy host 3 ms can end before the request reaches the node (nothing
    made, nothing to close)."""
    every = states.ALL
    headers = {"X-API-KEY": KEY}
    for timeout in (0.003, 0.01, 0.03, 0.1, 0.3):
        before = {r.id for r in node.records(every)}
        async with httpx.AsyncClient(base_url=e2b_env, headers=headers) as http:
            try:
                answered = await http.post("/sandboxes", json={"templateID": "base"},
                                           timeout=timeout)  # fmt: skip
            except httpx.TimeoutException:
                pass
            else:  # the create beat this timeout: a longer one would too
                await http.delete(f"/sandboxes/{answered.json()['sandboxID']}")
                pytest.fail(f"a create answered within {timeout} s: no client left mid-create")
        made: list[SandboxRecord] = []
        for _ in range(200):  # the node makes it, then closes it
            made = [r for r in node.records(every) if r.id not in before]
            if made and all(r.state in ("closed", "failed") for r in made):
                break
            await asyncio.sleep(0.05)
        if made:
            assert [r.state for r in made] == ["closed"], timeout
            return
    pytest.fail("no create was reached by a request whose client then left")


async def test_a_forks_copy_has_tokens_of_its_own(e2b_env: str, node: Node) -> None:
    """A copy is another sandbox: its source's envd and traffic tokens
    (held by whoever drove the source) must not open it."""
    from corral import labels

    s = await e2b.AsyncSandbox.create("base", timeout=120)
    try:
        async with node.http_client() as c:
            (copy,) = await c.sandboxes.fork(await c.sandboxes.get(s.sandbox_id), 1)
            try:
                tags = copy.info.labels
                assert tags[labels.E2B_TOKEN] != s._envd_access_token
                assert tags[labels.E2B_TRAFFIC_TOKEN] != s.traffic_access_token
                async with httpx.AsyncClient(base_url=e2b_env, timeout=30) as h:
                    for token, status in ((s._envd_access_token, 401),
                                          (tags[labels.E2B_TOKEN], 200)):  # fmt: skip
                        r = await h.post(
                            "/filesystem.Filesystem/Stat", json={"path": "/"},
                            headers={"E2b-Sandbox-Id": copy.id, "X-Access-Token": token},
                        )  # fmt: skip
                        assert r.status_code == status, r.text
            finally:
                await copy.close()
    finally:
        await s.kill()
