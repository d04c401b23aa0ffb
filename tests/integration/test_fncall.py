"""Function calls on real workers: languages, verdicts, clean state between
calls, the general API's kind="fncall", and SandboxFusion's own client
against `corral serve`."""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import pytest

import corral
from corral import labels
from corral.api.models import CommitRequest, CreateSandbox, FnCallRequest
from corral.node.fncall import call

from ..framework import IMAGE, Node, Server

C_OK = '#include <stdio.h>\nint main(void){int a,b;scanf("%d %d",&a,&b);printf("%d\\n",a+b);}\n'
CPP_OK = "#include <iostream>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a*b<<std::endl;}\n"


PYTEST_OK = "def add(a, b):\n    return a + b\n\ndef test_add():\n    assert add(2, 3) == 5\n"
PYTEST_FAIL = "def test_add():\n    assert 1 + 1 == 3\n"
# What code problems import: the fncall-python toolkit of the default workers.
PACKAGES = (
    "import requests, numpy, pandas, scipy, sympy, networkx, sklearn, bs4\n"
    # and some of the rest of SandboxFusion's python runtime
    "import statsmodels.api, xgboost, rdkit.Chem, cvxpy, faker, gensim, redis, cv2\n"
    "print(int(numpy.sum(numpy.arange(4))))"
)


@pytest.fixture
def one_worker(fresh_node: Node) -> Node:
    """A node whose pool has a single worker: every call reuses it."""
    return fresh_node.with_config(fncall_workers=1)


@pytest.mark.parametrize(
    ("language", "code", "stdin", "out"),
    [
        ("python", "import sys; print(sum(map(int, sys.stdin.read().split())))", "2 3", "5\n"),
        ("bash", 'read a b; echo $((a + b)); echo "$0"', "2 3", "5\nmain.sh\n"),
        ("c", C_OK, "2 3", "5\n"),
        ("cpp", CPP_OK, "6 7", "42\n"),
        ("python", PACKAGES, "", "6\n"),
    ],
)
async def test_each_language_runs(
    client: corral.AsyncClient, language: str, code: str, stdin: str, out: str
) -> None:
    r = await client.fncall.run(language, code, stdin=stdin, run_timeout=60)  # cold imports
    assert (r.status, r.stdout, r.exit_code) == ("ok", out, 0), r
    assert r.wall_time > 0 and r.peak_memory > 0
    if language in ("c", "cpp"):
        assert r.compile is not None and r.compile.exit_code == 0
    else:
        assert r.compile is None


async def test_pytest_judges_a_test_module(client: corral.AsyncClient) -> None:
    ok = await client.fncall.run("pytest", PYTEST_OK)
    assert ok.status == "ok" and "1 passed" in ok.stdout
    bad = await client.fncall.run("pytest", PYTEST_FAIL)
    assert bad.status == "runtime_error" and "1 failed" in bad.stdout


async def test_verdicts(client: corral.AsyncClient) -> None:
    cases = [
        ("c", "int main(void) { return missing; }", {}, "compile_error"),
        ("python", "raise SystemExit(3)", {}, "runtime_error"),
        ("python", "import os; os.kill(os.getpid(), 11)", {}, "runtime_error"),
        ("python", "import time; time.sleep(30)", {"run_timeout": 1}, "timeout"),
        ("c", "int main(void){for(;;);}", {"run_timeout": 1}, "timeout"),
        (
            "python",
            "x = bytearray(400 * 1024 * 1024); print(len(x))",
            {"memory": "64MiB"},
            "memory_exceeded",
        ),
        ("python", "print('y' * 100000)", {"output_limit": 1024}, "output_limit"),
    ]
    results = await client.fncall.run_many(
        [{"language": lang, "code": code, **kw} for lang, code, kw, _ in cases], concurrency=4
    )
    for (lang, code, _kw, want), r in zip(cases, results, strict=True):
        assert isinstance(r, corral.FnCallResult) and r.status == want, (lang, code, r)
    compile_error, _, segv, slow, _, oom, flood = results
    assert "missing" in compile_error.compile_output and compile_error.run is None
    assert segv.exit_code == -11
    assert slow.run is not None and slow.run.timed_out and slow.wall_time < 5
    assert oom.run is not None and oom.run.signal == 9
    assert len(flood.stdout) == 1024 and flood.run is not None and flood.run.truncated


async def test_files_in_and_out(client: corral.AsyncClient) -> None:
    r = await client.fncall.run(
        "python",
        "d = open('data.bin', 'rb').read(); open('out.txt', 'w').write(str(len(d)))",
        files={"data.bin": b"\x00\x01\x02" * 10},
        fetch_files=["out.txt", "never-written.txt"],
    )
    assert r.status == "ok" and r.files == {"out.txt": b"30"}


async def test_nested_files_and_fetch_paths(client: corral.AsyncClient) -> None:
    """SandboxFusion's `files` may be nested ("dir1/dir2/secret_flag") and
    its `fetch_files` relative or absolute; both stay the call's user's."""
    r = await client.fncall.run(
        "python",
        "import os\n"
        "print(open('dir1/dir2/secret_flag').read())\n"
        "os.makedirs('out/deep', exist_ok=True)\n"
        "open('out/deep/r.txt', 'w').write('nested')\n"
        "open('/tmp/abs.txt', 'w').write('absolute')\n",
        files={"dir1/dir2/secret_flag": b"flag{1}", "dir1/top.txt": b"t"},
        fetch_files=["out/deep/r.txt", "/tmp/abs.txt", "/etc/shadow", "dir1/top.txt"],
    )
    assert r.status == "ok" and r.stdout == "flag{1}\n"
    # /etc/shadow is root's: the call's user reads nothing of it.
    assert r.files == {"out/deep/r.txt": b"nested", "/tmp/abs.txt": b"absolute",
                       "dir1/top.txt": b"t"}  # fmt: skip


LOOPBACK = """
import socket, threading, time
s = socket.socket()
s.bind(("127.0.0.1", 8080))  # the same port in every call
s.listen()
def serve():
    c, _ = s.accept()
    c.sendall(c.recv(100).upper())
    c.close()
threading.Thread(target=serve).start()
time.sleep(0.5)  # both calls hold the port at once
k = socket.create_connection(("localhost", 8080))  # /etc/hosts has it
k.sendall(b"hello")
print(k.recv(100).decode())
try:
    socket.create_connection(("192.0.2.1", 80), timeout=1)  # a TEST-NET address: outside
    print("outside reached")
except OSError:
    print("no way out")
"""


async def test_a_call_talks_to_its_own_loopback_servers(client: corral.AsyncClient) -> None:
    """Each call has its own network namespace with only lo: two calls bind
    the same port at the same time, and neither reaches anything outside."""
    a, b = await asyncio.gather(client.fncall.run("python", LOOPBACK),
                                client.fncall.run("python", LOOPBACK))  # fmt: skip
    for r in (a, b):
        assert r.status == "ok" and r.stdout == "HELLO\nno way out\n", r.stderr


async def test_nothing_of_a_call_reaches_the_next(one_worker: Node) -> None:
    leave = (
        "export SECRET=1; echo a > /tmp/left; echo b > /work/left; echo c > /dev/shm/left; "
        "echo d > /mnt/left; "
        "mkdir -p /tmp/d/e && touch /tmp/d/e/f; ln -s / /tmp/root-link; "
        "ipcmk -M 4096 >/dev/null; ipcmk -Q >/dev/null; "
        "(setsid sleep 1000 >/dev/null 2>&1 &); nohup sleep 1000 >/dev/null 2>&1 & "
        "touch /etc/left 2>/dev/null || echo read-only"
    )
    look = (
        "ls -A /tmp /work /mnt /dev/shm | grep -v -e '^/' -e '^main.sh$' -e '^$' || true; "
        "echo secret=${SECRET:-}; cat /proc/[0-9]*/comm | sort | uniq -c | grep -c sleep; "
        "ipcs -m -q | grep -c '^0x' || true"
    )
    async with one_worker.client() as c:
        r = await c.fncall.run("bash", leave)
        assert r.status == "ok" and r.stdout == "read-only\n", r
        r = await c.fncall.run("bash", look)
        assert r.stdout.split() == ["secret=", "0", "0"], r
        assert one_worker.fncall_workers() == 1  # the same worker ran both


async def test_a_fork_bomb_costs_only_its_call(one_worker: Node) -> None:
    # The bomb's shell returns at once; its children fork on until the
    # worker's pids limit, and die with the reset.
    async with one_worker.client() as c:
        r = await c.fncall.run("bash", ":(){ :|:& };:; sleep 1", run_timeout=2)
        assert "Resource temporarily unavailable" in r.stderr, r
        r = await c.fncall.run("python", "print('after the bomb')")
        assert (r.status, r.stdout) == ("ok", "after the bomb\n"), r


async def test_unknown_language_and_image(client: corral.AsyncClient) -> None:
    with pytest.raises(corral.InvalidArgument) as exc:
        await client.fncall.run("cobol", "DISPLAY 'HI'.")
    assert exc.value.field == "language" and "python" in exc.value.rule
    with pytest.raises(corral.ImageNotFound):
        await client.fncall.run("python", "print(1)", image="no-such-image:1")


async def test_run_many_streams_as_calls_finish(client: corral.AsyncClient) -> None:
    order: list[int] = []
    calls = [
        {"language": "bash", "code": "sleep 1.5; echo slow"},
        {"language": "bash", "code": "echo fast"},
    ]
    results = await client.fncall.run_many(
        calls, concurrency=2, on_result=lambda i, _r: order.append(i)
    )
    assert [getattr(r, "stdout", r) for r in results] == ["slow\n", "fast\n"]
    assert order == [1, 0]


async def test_run_many_reports_a_failed_call_and_runs_the_rest(
    client: corral.AsyncClient,
) -> None:
    calls = [
        {"language": "python", "code": "print(1)"},
        {"language": "python", "code": "print(2)", "image": "no-such-image:1"},
        {"language": "python", "code": "print(3)", "memory": "15GiB"},  # over the ceiling
        {"language": "python", "code": "print(4)"},
    ]
    ok1, missing, too_big, ok4 = await client.fncall.run_many(calls, concurrency=2)
    assert isinstance(ok1, corral.FnCallResult) and ok1.stdout == "1\n"
    assert isinstance(missing, corral.ImageNotFound)
    assert isinstance(too_big, corral.InvalidArgument) and too_big.field == "memory"
    assert isinstance(ok4, corral.FnCallResult) and ok4.stdout == "4\n"


async def test_a_reset_that_cannot_empty_a_worker_discards_it(one_worker: Node) -> None:
    # Deeper than the fds corral-init may open while it empties /tmp (the
    # nofile limit is far below this on these hosts: 20000).
    deep = (
        "import os\n"
        "os.chdir('/tmp')\n"
        "for i in range(30000):\n"
        "    os.mkdir('d'); os.chdir('d')\n"
        "open('secret', 'w').write('left behind')\n"
    )
    async with one_worker.client() as c:
        r = await c.fncall.run("python", deep, run_timeout=60)
        assert r.status == "ok", r
        for _ in range(200):  # the failed reset closes the worker in the background
            if one_worker.fncall_workers("fncall:bookworm") == 0:
                break
            await asyncio.sleep(0.1)
        assert one_worker.fncall_workers("fncall:bookworm") == 0
        r = await c.fncall.run("bash", "ls -A /tmp | wc -l")
        assert r.stdout == "0\n"


async def test_general_api_fncall_sandbox_is_stateless(client: corral.AsyncClient) -> None:
    sbx = await client.sandboxes.create(kind="fncall", image="fncall:bookworm")
    try:
        await sbx.files.write("/work/input.txt", b"given")
        r = await sbx.commands.run("cat /work/input.txt; echo x > /tmp/t; touch /usr/x")
        assert r.stdout == "given" and "Read-only file system" in r.stderr
        r = await sbx.commands.run("ls -A /work /tmp")
        assert r.stdout.split() == ["/tmp:", "/work:"], r
    finally:
        await sbx.close()


async def test_bad_calls_over_http_leave_nothing(server: Server) -> None:
    async with httpx.AsyncClient(
        transport=httpx.AsyncHTTPTransport(uds=str(server.sock)), base_url="http://corral"
    ) as http:

        async def everything() -> list[str]:
            pooled = await http.get("/v1/sandboxes", params={"label": "corral.pool=fncall"})
            other = await http.get("/v1/sandboxes")
            return sorted(s["id"] for r in (pooled, other) for s in r.json()["sandboxes"])

        before = await everything()
        cases: list[tuple[dict[str, object], str, tuple[str, ...]]] = [
            ({"language": "cobol", "code": "x"}, "language", ("/v1/fncall", "/run_code")),
            ({"language": "python", "code": ""}, "code", ("/v1/fncall", "/run_code")),
            (
                {"language": "python", "code": "x" * (10 * 2**20)},
                "code",
                ("/v1/fncall", "/run_code"),
            ),
            (
                {"language": "python", "code": "1", "run_timeout": -1},
                "run_timeout",
                ("/v1/fncall", "/run_code"),
            ),
            (
                {"language": "python", "code": "1", "compile_timeout": 1e9},
                "compile_timeout",
                ("/v1/fncall", "/run_code"),
            ),
            (
                {"language": "python", "code": "1", "files": {"../x": ""}},
                "files",
                ("/v1/fncall", "/run_code"),
            ),
            (
                {"language": "python", "code": "1", "files": {"/etc/x": ""}},
                "files",
                ("/v1/fncall", "/run_code"),
            ),
            (
                {"language": "python", "code": "1", "fetch_files": ["f"] * 65},
                "fetch_files",
                ("/v1/fncall", "/run_code"),
            ),
            (
                {"language": "python", "code": "1", "stdin": "%%% not base64"},
                "stdin",
                ("/v1/fncall",),
            ),
            (
                {"language": "python", "code": "1", "files": {"a": "%%% not base64"}},
                "files.a",
                ("/run_code",),
            ),
            # Listed, but without a toolchain on this node.
            ({"language": "swift", "code": "print(1)"}, "language", ("/v1/fncall", "/run_code")),
            ({"cells": []}, "cells", ("/run_jupyter",)),
            ({"cells": ["1"], "kernel": "ir"}, "kernel", ("/run_jupyter",)),
            ({"cells": ["1"], "total_timeout": 1e6}, "total_timeout", ("/run_jupyter",)),
            ({"cells": ["1"], "files": {"../x": "aGk="}}, "files", ("/run_jupyter",)),
            ({"cells": ["1"], "files": {"a": "%%%"}}, "files.a", ("/run_jupyter",)),
        ]
        for body, field, paths in cases:
            for path in paths:
                resp = await http.post(path, json=body)
                assert resp.status_code == 400, (path, body, resp.text)
                err = resp.json()["error"]
                assert err["code"] == "invalid_argument", err
                assert err["field"] == field or err["field"].startswith(field + "."), (path, err)
        # A refused call takes no worker and makes no sandbox.
        assert await everything() == before


def _sandboxfusion_calls(endpoint: str) -> None:
    from sandbox_fusion import RunCodeRequest, RunStatus, run_code

    r = run_code(RunCodeRequest(code="print(1 + 1)", language="python"), endpoint=endpoint)
    assert r.status == RunStatus.Success and r.run_result.stdout == "2\n"
    r = run_code(RunCodeRequest(code=CPP_OK, language="cpp", stdin="6 7"), endpoint=endpoint)
    assert r.status == RunStatus.Success and r.run_result.stdout == "42\n"
    assert r.compile_result is not None and r.compile_result.return_code == 0
    r = run_code(
        RunCodeRequest(
            code="print(open('a.txt').read()); open('b.txt','w').write('out')",
            language="python",
            files={"a.txt": base64.b64encode(b"in").decode()},
            fetch_files=["b.txt"],
        ),
        endpoint=endpoint,
    )
    assert r.run_result.stdout == "in\n" and base64.b64decode(r.files["b.txt"]) == b"out"
    r = run_code(RunCodeRequest(code="int main(){ oops }", language="cpp"), endpoint=endpoint)
    assert r.status == RunStatus.Failed and r.run_result is None
    assert r.compile_result.return_code != 0
    r = run_code(
        RunCodeRequest(code="while True: pass", language="python", run_timeout=1),
        endpoint=endpoint,
    )
    assert r.status == RunStatus.Failed and r.run_result.status == "TimeLimitExceeded"


async def test_sandboxfusion_client_against_corral_serve(server: Server) -> None:
    # SandboxFusion's own client (requests, blocking): run it off the loop.
    await asyncio.to_thread(_sandboxfusion_calls, server.tcp_url)
    await asyncio.to_thread(_sandboxfusion_calls, server.tcp_url + "/v1")


def test_the_blocking_client_runs_calls(node: Node) -> None:
    with corral.Client(config=node.config) as c:
        r = c.fncall.run("python", "print(6 * 7)")
        seen: list[int] = []
        many = c.fncall.run_many(
            [{"language": "bash", "code": f"echo {i}"} for i in range(3)],
            on_result=lambda i, _r: seen.append(i),
        )
    assert r.stdout == "42\n"
    assert [getattr(m, "stdout", m) for m in many] == ["0\n", "1\n", "2\n"]
    assert sorted(seen) == [0, 1, 2]


async def test_the_nodes_workers_are_not_the_callers(client: corral.AsyncClient) -> None:
    await client.fncall.run("python", "print(1)")
    workers = await client.sandboxes.list(labels={"corral.pool": "fncall"})
    assert workers
    w = workers[0]
    for attempt in (
        w.commands.run("echo hijack"),
        w.files.write("/work/x", b"x"),
        w.files.read("/etc/hostname"),
        w.close(),
    ):
        with pytest.raises(corral.PermissionDenied):
            await attempt
    assert (await w.audit()).sandbox == w.id  # reading what it did is fine


async def test_calls_are_counted_in_the_metrics(server: Server) -> None:
    async with corral.AsyncClient(server.url) as c:
        await c.fncall.run("python", "print(1)")
        await c.fncall.run("python", "raise SystemExit(1)")
    async with httpx.AsyncClient(
        transport=httpx.AsyncHTTPTransport(uds=str(server.sock)), base_url="http://corral"
    ) as http:
        text = (await http.get("/metrics")).text
    assert 'corral_fncalls_total{language="python",status="ok"}' in text
    assert 'corral_fncalls_total{language="python",status="runtime_error"}' in text
    assert (
        'corral_fncall_workers{image="fncall:bookworm+fncall-python:bookworm,fncall-langs:bookworm,fncall-runners:bookworm",state="total"}'
        in text
    )


async def test_serve_warms_workers_before_the_first_call(fresh_node: Node) -> None:
    srv = fresh_node.server
    srv.env["CORRAL_FNCALL_WARM"] = "2"
    srv.start()
    async with fresh_node.http_client() as c:
        for _ in range(100):
            pool = await c.sandboxes.list(labels={"corral.pool": "fncall"})
            if [w.info.state.value for w in pool] == ["running", "running"]:
                break
            await asyncio.sleep(0.1)
        workers = await c.sandboxes.list(labels={"corral.pool": "fncall"})
        assert len(workers) == 2
        assert await c.sandboxes.list() == []  # the pool's are not the caller's
        r = await c.fncall.run("python", "print('warm')")
        assert r.stdout == "warm\n"
        assert len(await c.sandboxes.list(labels={"corral.pool": "fncall"})) == 2
    srv.stop()
    # The server closed its workers on the way out.
    assert fresh_node.records(labels={"corral.pool": "fncall"}) == []
    assert fresh_node.leftovers() == {}


# 0.05 s: the close comes while the call's worker is still being made.
@pytest.mark.parametrize("after", [0.05, 0.5])
async def test_closing_the_client_lets_calls_finish_and_retires_workers(
    fresh_node: Node, after: float
) -> None:
    c = fresh_node.client()
    await c.open()
    call = asyncio.create_task(c.fncall.run("bash", "sleep 1; echo finished"))
    await asyncio.sleep(after)
    await c.aclose()  # while the call runs
    r = await call
    assert r.stdout == "finished\n"
    assert fresh_node.records(labels={"corral.pool": "fncall"}) == []


async def test_images_share_the_workers_of_the_node(fresh_node: Node) -> None:
    # One worker per image and one in all: calling a second image retires
    # the first image's idle worker; calls on both at once both finish.
    node = fresh_node.with_config(fncall_workers=1, fncall_workers_total=1)
    async with node.client() as c:
        total = node.fncall_workers
        assert (await c.fncall.run("python", "print(1)")).stdout == "1\n"
        r = await c.fncall.run("python", "print(2)", image="debian-python:bookworm")
        assert r.stdout == "2\n" and total() == 1
        both = await asyncio.gather(
            c.fncall.run("bash", "sleep 0.5; echo a"),
            c.fncall.run("bash", "sleep 0.5; echo b", image="debian-python:bookworm"),
        )
        assert [b.stdout for b in both] == ["a\n", "b\n"]
        for _ in range(100):  # resets and retirements run in the background
            if total() <= 1:
                break
            await asyncio.sleep(0.05)
        assert total() <= 1


async def test_run_codes_memory_limit_is_the_calls(server: Server) -> None:
    async with httpx.AsyncClient(
        transport=httpx.AsyncHTTPTransport(uds=str(server.sock)), base_url="http://corral"
    ) as http:
        body = {"language": "python", "code": "x = bytearray(300 << 20)", "memory_limit_MB": 64}
        r = (await http.post("/run_code", json=body)).json()
        assert r["status"] == "Failed" and r["message"] == "memory_exceeded"
        body["memory_limit_MB"] = 512
        assert (await http.post("/run_code", json=body)).json()["status"] == "Success"
        body["memory_limit_MB"] = -1  # SandboxFusion's default: the call's default
        assert (await http.post("/run_code", json=body)).json()["status"] == "Success"
        assert (await http.get("/v1/ping")).json() == "pong"
        body["memory_limit_MB"] = 1
        bad = await http.post("/run_code", json=body)
        assert bad.status_code == 400 and bad.json()["error"]["field"] == "memory_limit_MB"


async def test_a_language_may_run_on_an_image_of_its_own(fresh_node: Node) -> None:
    # A node's own table adds a language whose workers are the bare function
    # image: no fncall-python toolkit, so no numpy there; the default
    # python still has it.
    fresh_node.config.data_dir.mkdir(parents=True, exist_ok=True)
    (fresh_node.config.data_dir / "fncall-languages.toml").write_text(
        '[python-bare]\nsource = "main.py"\nrun = ["python3", "main.py"]\n'
        'image = "fncall:bookworm"\n'
    )
    async with fresh_node.client() as c:
        code = "import importlib.util as u; print(u.find_spec('numpy') is not None)"
        assert (await c.fncall.run("python-bare", code)).stdout == "False\n"
        assert (await c.fncall.run("python", code)).stdout == "True\n"


async def test_a_call_that_stops_its_own_exec_handler_still_times_out(
    one_worker: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The handler that would end the call at its timeout runs as the
    call's user: code that stops every process it may (kill -STOP -1)
    stops it too. The host's own bound makes it a timeout, and the worker
    is clean for the next call."""
    monkeypatch.setattr(call, "STAGE_GRACE", 2.0)
    async with one_worker.client() as c:
        began = time.monotonic()
        r = await c.fncall.run(
            "python", "import os, signal, time\nos.kill(-1, signal.SIGSTOP)\ntime.sleep(60)",
            run_timeout=1,
        )  # fmt: skip
        assert r.status == "timeout", r
        assert time.monotonic() - began < 30
        r = await c.fncall.run("python", "print('next')")
        assert (r.status, r.stdout) == ("ok", "next\n"), r
        assert one_worker.fncall_workers() == 1


async def test_a_call_runs_on_no_layer_another_project_committed(fresh_node: Node) -> None:
    """Through a gateway a node labels a commit with the committing project,
    and runs no call of another project on it, whatever its digest: the
    layer is one this node lacks, for that project. Made here as a gateway
    makes them (a create carrying the platform's project label)."""
    async with fresh_node.client() as c:
        agent = fresh_node.agent
        made = CreateSandbox(image=IMAGE).model_copy(update={"labels": {labels.PROJECT: "rival"}})
        sbx = await agent.create(made)
        await agent.write_file(sbx.id, "/planted", b"theirs")
        req = CommitRequest(tag="projects/rival/planted:1", stack=True)
        layer = await agent.commit(sbx.id, req)
        await agent.close(sbx.id)
        assert layer.labels[labels.PROJECT] == "rival"
        code = "print(open('/planted').read())"
        for project in ("rival", None):  # its own project; a caller that owns the node
            request = FnCallRequest(
                language="python", code=code, image=layer.digest, project=project
            )
            assert (await c.service.run_call(request)).stdout == "theirs\n"
        request = FnCallRequest(language="python", code=code, image=layer.digest, project="acme")
        with pytest.raises(corral.ImageNotFound, match="is not in this node's store") as exc:
            await c.service.run_call(request)
        assert exc.value.details == {"field": "image", "ref": layer.digest}
    # Its workers gone with the client, the layer goes too (the store is the machine's).
    async with fresh_node.client() as c:
        await c.service.delete_layer(layer.digest)
