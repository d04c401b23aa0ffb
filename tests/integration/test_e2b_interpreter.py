"""The stock `e2b-code-interpreter` package from PyPI, unmodified, against
`corral serve`: its "code-interpreter-v1" template (Jupyter and Corral's
code-interpreter server on port 49999, reached through E2b-Sandbox-Port),
through every call it makes. (Its own test suite: `make e2b-conformance`.)"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from ..framework import Server
from ..framework.images import require_image

ci = pytest.importorskip(
    "e2b_code_interpreter", reason="e2b-code-interpreter (a dev dependency) is not installed"
)

KEY = "e2b_" + "0" * 40


@pytest.fixture
def e2b_env(server: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    require_image("e2b-ci-langs:bookworm")
    require_image("e2b-code-interpreter:bookworm")
    for k, v in {
        "E2B_API_URL": server.tcp_url, "E2B_SANDBOX_URL": server.tcp_url, "E2B_API_KEY": KEY,
        "E2B_DOMAIN": "corral.local",
    }.items():  # fmt: skip
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    yield server.tcp_url


@pytest.fixture
async def sbx(e2b_env: str) -> AsyncIterator[ci.AsyncSandbox]:
    s = await ci.AsyncSandbox.create(timeout=300, envs={"FROM_CREATE": "yes"})
    try:
        yield s
    finally:
        await s.kill()


async def test_python_runs_with_state_results_and_errors(sbx: ci.AsyncSandbox) -> None:
    seen: list[str] = []
    r = await sbx.run_code("x = 41\nprint('hi')\nx + 1", on_stdout=lambda m: seen.append(m.line))
    assert (r.text, r.logs.stdout, seen) == ("42", ["hi\n"], ["hi\n"])
    assert r.execution_count and r.error is None
    assert (await sbx.run_code("x")).text == "41"  # the default context keeps state
    r = await sbx.run_code("1 / 0")
    assert r.error is not None and r.error.name == "ZeroDivisionError"
    assert "ZeroDivisionError" in r.error.traceback
    # The sandbox's environment, and one of the call only.
    assert (await sbx.run_code("import os; os.environ['FROM_CREATE']")).text == "yes"
    r = await sbx.run_code("os.environ.get('ONCE')", envs={"ONCE": "1"})
    assert r.text == "1"
    assert (await sbx.run_code("os.environ.get('ONCE', 'gone')")).text == "gone"
    r = await sbx.run_code("import pathlib; str(pathlib.Path.cwd())")
    assert r.text == "/home/user"


async def test_rich_results_dataframes_and_charts(sbx: ci.AsyncSandbox) -> None:
    r = await sbx.run_code("import pandas as pd; pd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
    (res,) = r.results
    assert res.is_main_result and res.data == {"a": [1, 2], "b": [3, 4]} and res.html
    r = await sbx.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title('sq')\n"
        "plt.show()"
    )
    (fig,) = r.results
    assert fig.png and fig.chart is not None and fig.chart.title == "sq"
    assert (await sbx.run_code("{'k': [1, 2]}")).results[0].json == {"k": [1, 2]}


async def test_javascript_typescript_and_bash_kernels(sbx: ci.AsyncSandbox) -> None:
    r = await sbx.run_code("console.log('from js'); 6 * 7", language="js")
    assert r.logs.stdout == ["from js\n"] and r.text == "42"
    r = await sbx.run_code("const n: number = 2; n * 21", language="ts")
    assert r.text == "42"
    assert (await sbx.run_code("process.cwd()", language="js")).text == "/home/user"
    r = await sbx.run_code("echo $((6 * 7)); pwd", language="bash")
    assert "".join(r.logs.stdout) == "42\n/home/user\n"


async def test_r_kernel_with_env_and_cwd(sbx: ci.AsyncSandbox) -> None:
    async def shown(code: str, **kw: Any) -> str | None:
        # IRkernel shows a value as display data, not as the main result.
        r = await sbx.run_code(code, language="r", **kw)
        assert r.error is None, r.error
        return r.results[0].text if r.results else None

    r = await sbx.run_code('print("hi")', language="r")
    assert r.logs.stdout == ['[1] "hi"\n']
    assert await shown("6 * 7") == "[1] 42"
    assert await shown("getwd()") == '[1] "/home/user"'
    assert await shown('Sys.getenv("FROM_CREATE")') == '[1] "yes"'
    assert await shown('Sys.getenv("ONCE")', envs={"ONCE": 'a "q" b'}) == '[1] "a \\"q\\" b"'
    assert await shown('Sys.getenv("ONCE", unset = "gone")') == '[1] "gone"'
    # The restore touches none of the user's names, and survives rm(list = ls()).
    await sbx.run_code('k <- "mine"', language="r")
    await shown('Sys.getenv("ONCE")', envs={"ONCE": "x"})
    assert await shown("k") == '[1] "mine"'
    await shown("rm(list = ls()); 1", envs={"ONCE": "y"})
    assert await shown('Sys.getenv("ONCE", unset = "gone")') == '[1] "gone"'
    r = await sbx.run_code('stop("boom")', language="r")
    assert r.error is not None and "boom" in r.error.value


async def test_java_kernel_streams_results_errors_and_env(sbx: ci.AsyncSandbox) -> None:
    """Corral's Java kernel (JShell): as IJava, a println streams its text and
    its line end apart, the last expression is the result, env vars are
    system properties, and a cell stops at its first error."""
    r = await sbx.run_code('System.out.println("Hello"); int x = 41;\nx + 1', language="java")
    assert (r.logs.stdout, r.text) == (["Hello", "\n"], "42")
    assert (await sbx.run_code("x", language="java")).text == "41"  # state is kept
    r = await sbx.run_code('System.getProperty("user.dir")', language="java")
    assert r.text == "/home/user"
    assert (await sbx.run_code('System.getProperty("FROM_CREATE")', language="java")).text == "yes"
    once = 'line\nbreak "q" \\u00e9 é'
    r = await sbx.run_code('System.getProperty("ONCE")', envs={"ONCE": once}, language="java")
    assert r.text == once
    r = await sbx.run_code('System.getProperty("ONCE", "gone")', language="java")
    assert r.text == "gone"
    assert (await sbx.run_code("x = 7", language="java")).results == []  # as IJava: no result
    r = await sbx.run_code('int y = "no";', language="java")
    assert r.error is not None and r.error.name == "CompilationException"
    assert "incompatible types" in r.error.value
    r = await sbx.run_code('System.out.print("a");\nInteger.parseInt("z");\nSystem.out.print("b");',
                           language="java")  # fmt: skip
    assert r.logs.stdout == ["a"]  # the cell stopped at the exception
    assert r.error is not None and r.error.name == "java.lang.NumberFormatException"
    assert "NumberFormatException" in r.error.traceback


async def test_java_kernel_is_interrupted_and_outlives_system_exit(sbx: ci.AsyncSandbox) -> None:
    await sbx.run_code("long n = 1;", language="java")  # long: 3 s of n++ overflow an int
    with pytest.raises(ci.TimeoutException):
        await sbx.run_code("while (true) { n++; }", language="java", timeout=3)
    # The abandoned loop was stopped: the next cell runs, with the state.
    assert (await sbx.run_code("n > 1", language="java", timeout=30)).text == "true"
    # A class of the user's named System changes nothing of the platform's code.
    await sbx.run_code("class System { }", language="java")
    r = await sbx.run_code(
        'java.lang.System.getProperty("ONCE")', envs={"ONCE": "z"}, language="java"
    )
    assert r.text == "z"
    r = await sbx.run_code('java.lang.System.getProperty("ONCE", "gone")', language="java")
    assert r.text == "gone"
    # Its env vars are put back on a JVM that is gone: nothing fails.
    r = await sbx.run_code("java.lang.System.exit(3);", language="java", envs={"ONCE": "1"})
    assert r.error is not None and r.error.name == "JVMExited" and "status 3" in r.error.value
    # A new JVM: the kernel answers, without the old state.
    assert (await sbx.run_code("1 + 1", language="java")).text == "2"
    assert (await sbx.run_code("n", language="java")).error is not None


async def test_contexts_are_separate_kernels(sbx: ci.AsyncSandbox) -> None:
    ctx = await sbx.create_code_context(cwd="/tmp")
    await sbx.run_code("y = 1")
    r = await sbx.run_code("y", context=ctx)
    assert r.error is not None and r.error.value == "name 'y' is not defined"
    assert (await sbx.run_code("import os; os.getcwd()", context=ctx)).text == "/tmp"
    assert ctx.id in {c.id for c in await sbx.list_code_contexts()}
    await sbx.run_code("z = 5", context=ctx)
    await sbx.restart_code_context(ctx)
    assert (await sbx.run_code("z", context=ctx)).error is not None  # restarted: state gone
    await sbx.remove_code_context(ctx)
    assert ctx.id not in {c.id for c in await sbx.list_code_contexts()}
    with pytest.raises(ci.NotFoundException):
        await sbx.run_code("1", context=ctx)
    with pytest.raises(ci.InvalidArgumentException):
        await sbx.run_code("1", context=ctx, language="python")


async def test_an_abandoned_execution_is_interrupted(sbx: ci.AsyncSandbox) -> None:
    with pytest.raises(ci.TimeoutException):
        await sbx.run_code("import time; time.sleep(120)", timeout=2)
    # The kernel was interrupted when the client went away: the next call
    # is not queued behind the sleep.
    assert (await sbx.run_code("1 + 1", timeout=30)).text == "2"


async def test_the_port_is_closed_without_the_sandboxs_token(
    sbx: ci.AsyncSandbox, e2b_env: str
) -> None:
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999"}
    async with httpx.AsyncClient(base_url=e2b_env) as c:
        assert (await c.get("/health", headers=headers)).status_code == 401
        ok = await c.get(
            "/health", headers={**headers, "E2B-Traffic-Access-Token": sbx.traffic_access_token}
        )
        assert ok.status_code == 200 and ok.json() == "OK"
        bad = await c.post("/execute", headers={**headers, "X-Access-Token":
                           sbx.traffic_access_token}, json={"code": 1})  # fmt: skip
        assert bad.status_code == 400 and "code" in bad.text


async def test_the_servers_come_back_after_being_killed(sbx: ci.AsyncSandbox) -> None:
    """The template's supervisor restarts what dies, as E2B's systemd units
    do: the code-interpreter server alone, or both with Jupyter."""
    health = (
        "python3 -c 'import urllib.request as u, time\n"
        "for _ in range(300):\n"
        "    try:\n"
        '        u.urlopen("http://127.0.0.1:49999/health", timeout=1); break\n'
        "    except OSError: time.sleep(0.1)\n"
        "else: raise SystemExit(1)'"
    )
    # The image has no pkill: match the argv (@ for its NULs), sparing the
    # killer and its shell, whose argv name the victim too. A process may
    # end between the listing and the read (seen in CI): skipped.
    kill = (
        "python3 -c 'import os, sys\nn = 0\n"
        'for p in set(filter(str.isdigit, os.listdir("/proc"))) - {str(os.getpid()), str(os.getppid())}:\n'
        "    try:\n"
        '        argv = open(f"/proc/{p}/cmdline", "rb").read()\n'
        "    except OSError:\n"
        "        continue\n"
        '    if sys.argv[1].encode().replace(b"@", bytes(1)) in argv:\n'
        "        os.kill(int(p), 9); n += 1\nprint(n)' "
    )
    for victim in ("interpreter/server.py", "bin/jupyter-server@"):
        killed = await sbx.commands.run(kill + victim, user="root")
        assert int(killed.stdout) >= 1
        await sbx.commands.run(health, timeout=60)
        assert (await sbx.run_code("6 * 7")).text == "42"


async def test_a_timeout_shorter_than_the_start_counts_from_when_it_is_handed_out(
    e2b_env: str,
) -> None:
    """The template's start (Jupyter, seconds) is part of the create; a
    timeout shorter than it closed the sandbox under its own start, and the
    create answered 404 "was closed" (seen in E2B's suite on a loaded host).
    It now runs from the create's answer."""
    s = await ci.AsyncSandbox.create(timeout=2)  # before: SandboxException 404 "was closed"
    await s.kill()
