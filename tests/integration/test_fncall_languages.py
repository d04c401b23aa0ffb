"""SandboxFusion's languages on real workers (the fncall-langs toolkit):
each one reads stdin and prints, fails at run time, fails to compile where
it compiles, and is stopped at its timeout; the test runners (go_test,
junit, jest, D's unittest) pass and fail; a language without a toolchain
is refused by name; Jupyter cells run on a warm kernel."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

import corral

from ..framework import Server

# language -> (reads an integer on stdin and prints twice it, fails at run time)
PROGRAMS: dict[str, tuple[str, str]] = {
    "go": (
        'package main\nimport "fmt"\nfunc main() { var n int; fmt.Scan(&n); fmt.Println(n * 2) }',
        'package main\nfunc main() { panic("boom") }',
    ),
    "java": (
        "import java.util.Scanner;\npublic class Main { public static void main(String[] a) "
        "{ System.out.println(new Scanner(System.in).nextInt() * 2); } }",
        "public class Main { public static void main(String[] a) { assert 1 == 2; } }",
    ),
    "nodejs": (
        "const n = parseInt(require('fs').readFileSync(0, 'utf8')); console.log(n * 2);",
        "require('assert').strictEqual(1, 2);",
    ),
    "typescript": (
        "import * as fs from 'fs';\nconst n: number = parseInt(fs.readFileSync(0, 'utf8'));"
        " console.log(n * 2);",
        "const x: number = 1; if (x === 1) { throw new Error('boom'); }",
    ),
    "php": ("<?php $n = intval(trim(fgets(STDIN))); echo $n * 2, PHP_EOL;", "exit(3);"),
    "csharp": (
        "using System; public class Program { public static void Main() "
        "{ Console.WriteLine(int.Parse(Console.ReadLine()) * 2); } }",
        "using System.Diagnostics; public class Program { public static void Main() "
        '{ Debug.Assert(1 == 2, "Assertion failed"); } }',
    ),
    "rust": (
        "use std::io::Read;\nfn main() { let mut s = String::new(); "
        "std::io::stdin().read_to_string(&mut s).unwrap(); "
        'let n: i64 = s.trim().parse().unwrap(); println!("{}", n * 2); }',
        'fn main() { assert_eq!(1, 2, "boom"); }',
    ),
    "lua": ("local n = io.read('n'); print(math.floor(n * 2))", "error('boom')"),
    "R": (
        "n <- as.integer(readLines(file('stdin'), n = 1)); cat(n * 2, '\\n', sep = '')",
        "stop('boom')",
    ),
    "perl": ('my $n = <STDIN>; print $n * 2, "\\n";', "die 'boom';"),
    "ruby": ("puts gets.to_i * 2", "raise 'boom'"),
    "scala": (
        "object Main { def main(args: Array[String]): Unit = "
        "println(scala.io.StdIn.readLine().trim.toInt * 2) }",
        'object Main { def main(args: Array[String]): Unit = throw new Exception("boom") }',
    ),
    "kotlin_script": ("println(readLine()!!.trim().toInt() * 2)", 'throw Exception("boom")'),
    "racket": ("#lang racket\n(displayln (* 2 (read)))", '#lang racket\n(error "boom")'),
}
# language -> code that does not compile (the languages with a compile step)
COMPILE_ERRORS = {
    "go": "package main\nfunc main() { undefined() }",
    "java": "public class Main { public static void main(String[] a) { System.uto.println(1); } }",
    "csharp": "public class Program { public static void Main() { Undefined(); } }",
    "rust": 'fn main() { let x: i32 = "no"; }',
    "scala": "object Main { def main(args: Array[String]): Unit = undefined() }",
    "D_ut": "void main() { undefined(); }",
    "verilog": "module tb; initial begin $display(; end endmodule",
}
# language -> code that never ends
FOREVER = {
    "go": "package main\nfunc main() { for {} }",
    "java": "public class Main { public static void main(String[] a) { while (true) {} } }",
    "nodejs": "while (true) {}",
    "php": "while (true) {}",
    "ruby": "loop {}",
    "lua": "while true do end",
}


async def test_each_language_reads_stdin_and_fails_at_run_time(
    client: corral.AsyncClient,
) -> None:
    calls: list[dict[str, Any]] = []
    for lang, (ok, bad) in PROGRAMS.items():
        limits = {"compile_timeout": 120, "run_timeout": 60}
        calls.append({"language": lang, "code": ok, "stdin": b"21\n", **limits})
        calls.append({"language": lang, "code": bad, **limits})
    results = await client.fncall.run_many(calls, concurrency=2)
    for i, lang in enumerate(PROGRAMS):
        ok, bad = results[2 * i], results[2 * i + 1]
        assert isinstance(ok, corral.FnCallResult) and isinstance(bad, corral.FnCallResult)
        assert (ok.status, ok.stdout.strip()) == ("ok", "42"), (lang, ok)
        assert bad.status == "runtime_error" and bad.exit_code != 0, (lang, bad)
    by_lang = dict(zip(PROGRAMS, results[1::2], strict=True))
    assert isinstance(by_lang["csharp"], corral.FnCallResult)
    assert "Assertion failed" in by_lang["csharp"].stderr  # as .NET's Debug.Assert says it
    assert isinstance(by_lang["java"], corral.FnCallResult)
    assert "AssertionError" in by_lang["java"].stderr  # assertions are on (-ea)


async def test_compile_errors_are_the_compile_steps(client: corral.AsyncClient) -> None:
    calls = [
        {"language": lang, "code": code, "compile_timeout": 120}
        for lang, code in COMPILE_ERRORS.items()
    ]
    results = await client.fncall.run_many(calls, concurrency=2)
    for lang, r in zip(COMPILE_ERRORS, results, strict=True):
        assert isinstance(r, corral.FnCallResult)
        assert r.status == "compile_error" and r.run is None, (lang, r)
        assert r.compile is not None and r.compile.exit_code != 0 and r.compile_output


async def test_a_call_that_never_ends_is_stopped(client: corral.AsyncClient) -> None:
    calls = [
        {"language": lang, "code": code, "run_timeout": 1, "compile_timeout": 60}
        for lang, code in FOREVER.items()
    ]
    results = await client.fncall.run_many(calls, concurrency=2)
    for lang, r in zip(FOREVER, results, strict=True):
        assert isinstance(r, corral.FnCallResult) and r.status == "timeout", (lang, r)
        assert r.run is not None and r.run.timed_out and r.run.wall_time < 5


GO_TEST = (
    'package main\nimport ("testing"; "github.com/stretchr/testify/assert")\n'
    "func Add(a, b int) int { return a + b }\n"
    "func TestAdd(t *testing.T) { assert.Equal(t, %s, Add(2, 3)) }\n"
)
JUNIT = (
    "import org.junit.jupiter.api.Test;\nimport static org.junit.jupiter.api.Assertions.*;\n"
    "public class Adder { static int add(int a, int b) { return a + b; } }\n"
    "class AdderTest { @Test void adds() { assertEquals(%s, Adder.add(2, 3)); } }\n"
)
JEST = (
    "import { expect, test } from '@jest/globals';\nimport _ from 'lodash';\n"
    "test('adds', () => { expect(_.add(2, 3)).toBe(%s); });\n"
)
D_UT = "int add(int a, int b) { return a + b; }\nunittest { assert(add(2, 3) == %s); }\nvoid main() {}\n"
LUAUNIT = "local lu = require('luaunit')\nlu.assertEquals(2 + 3, %s)\n"


@pytest.mark.parametrize(
    ("language", "template"),
    [("go_test", GO_TEST), ("junit", JUNIT), ("jest", JEST), ("D_ut", D_UT), ("lua", LUAUNIT)],
)
async def test_test_runners_pass_and_fail(
    client: corral.AsyncClient, language: str, template: str
) -> None:
    kw = {"compile_timeout": 120, "run_timeout": 60}
    good, bad = await client.fncall.run_many(
        [
            {"language": language, "code": template % "5", **kw},
            {"language": language, "code": template % "6", **kw},
        ],
        concurrency=2,
    )
    assert isinstance(good, corral.FnCallResult) and good.status == "ok", good
    assert isinstance(bad, corral.FnCallResult) and bad.status == "runtime_error", bad


async def test_jest_writes_its_json_report(client: corral.AsyncClient) -> None:
    r = await client.fncall.run(
        "jest", JEST % "5", fetch_files=["jest-report.json"], run_timeout=60
    )
    assert r.status == "ok", r
    report = json.loads(r.files["jest-report.json"])
    assert report["numPassedTests"] == 1 and report["numFailedTests"] == 0


async def test_sql_and_verilog(client: corral.AsyncClient) -> None:
    sql = await client.fncall.run(
        "sql", "create table t(x); insert into t values (20), (22); select sum(x) from t;"
    )
    assert (sql.status, sql.stdout) == ("ok", "42\n"), sql
    assert sql.worker  # the worker that ran it (SandboxFusion's executor_pod_name)
    bad_sql = await client.fncall.run("sql", "select * from missing;")
    assert bad_sql.status == "runtime_error" and "no such table" in bad_sql.stderr
    vlog = await client.fncall.run(
        "verilog", 'module tb; initial begin $display("%0d", 6 * 7); $finish; end endmodule'
    )
    assert (vlog.status, vlog.stdout.strip()) == ("ok", "42"), vlog


async def test_nested_files_reach_each_toolchain(client: corral.AsyncClient) -> None:
    files = {"data/in/n.txt": b"21"}
    node = await client.fncall.run(
        "nodejs",
        "const fs = require('fs'); const n = +fs.readFileSync('data/in/n.txt', 'utf8');"
        " fs.mkdirSync('out'); fs.writeFileSync('out/r.txt', String(n * 2));",
        files=files,
        fetch_files=["out/r.txt"],
    )
    assert node.status == "ok" and node.files == {"out/r.txt": b"42"}, node
    go = await client.fncall.run(
        "go",
        'package main\nimport ("fmt"; "os")\n'
        'func main() { b, _ := os.ReadFile("data/in/n.txt"); fmt.Print(string(b)) }',
        files=files,
    )
    assert (go.status, go.stdout) == ("ok", "21"), go


NODE_SERVER = """
const http = require('http');
const server = http.createServer((req, res) => res.end('pong ' + req.url));
server.listen(8080, 'localhost', () => {
  http.get('http://localhost:8080/x', (res) => {
    let body = '';
    res.on('data', (c) => (body += c));
    res.on('end', () => { console.log(body); server.close(); });
  });
});
"""
GO_SERVER = """package main
import ("fmt"; "io"; "net"; "net/http")
func main() {
    l, _ := net.Listen("tcp", "127.0.0.1:8080")
    go http.Serve(l, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
        fmt.Fprint(w, "pong ", r.URL.Path) }))
    r, err := http.Get("http://localhost:8080/x")
    if err != nil { panic(err) }
    b, _ := io.ReadAll(r.Body); fmt.Println(string(b))
}
"""


async def test_loopback_servers_in_other_languages(client: corral.AsyncClient) -> None:
    # Two calls at once on the same port: each has its own loopback.
    calls = [
        {"language": "nodejs", "code": NODE_SERVER, "run_timeout": 20},
        {"language": "go", "code": GO_SERVER, "run_timeout": 20, "compile_timeout": 60},
        {"language": "nodejs", "code": NODE_SERVER, "run_timeout": 20},
    ]
    for r in await client.fncall.run_many(calls, concurrency=3):
        assert isinstance(r, corral.FnCallResult) and r.status == "ok", r
        assert r.stdout.strip() == "pong /x"


@pytest.mark.parametrize("language", ["swift", "julia", "lean"])
async def test_a_language_without_a_toolchain_is_refused_by_name(
    client: corral.AsyncClient, language: str
) -> None:
    with pytest.raises(corral.InvalidArgument) as e:
        await client.fncall.run(language, "print(1)")
    assert e.value.details["field"] == "language" and "no toolchain" in str(e.value)
    assert language in str(e.value)


async def test_run_jupyter_cells_on_a_warm_kernel(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.tcp_url, timeout=120) as http:
        body = {
            "cells": ['a = "hi"', "a", "import sys; sys.stderr.write('e\\n')", "1/0", "print(a)"]
        }
        r = (await http.post("/run_jupyter", json=body)).json()
        assert r["status"] == "Success", r
        cells = r["cells"]
        assert cells[1]["display"][0]["text/plain"] == "'hi'"
        assert cells[2]["stderr"] == "e\n"
        assert cells[3]["error"][0]["ename"] == "ZeroDivisionError"
        assert cells[4]["stdout"] == "hi\n"  # a cell that raises does not stop the next
        assert r["executor_pod_name"]  # the worker that ran the cells

        # The next call gets a fresh kernel: nothing of the last one is left.
        r = (await http.post("/run_jupyter", json={"cells": ["print(a)"]})).json()
        assert r["cells"][0]["error"][0]["ename"] == "NameError", r

        plot = "import matplotlib.pyplot as plt\nplt.plot([1, 2], [3, 4]); plt.show()"
        r = (await http.post("/run_jupyter", json={"cells": [plot]})).json()
        assert "image/png" in r["cells"][0]["display"][0], r

        files = {"d/x.txt": "NDI="}  # "42"
        body = {
            "cells": ["open('d/y.txt', 'w').write(open('d/x.txt').read())"],
            "files": files,
            "fetch_files": ["d/y.txt"],
        }
        r = (await http.post("/run_jupyter", json=body)).json()
        assert r["files"] == {"d/y.txt": "NDI="}, r


async def test_a_jupyter_cell_that_never_ends_is_interrupted(server: Server) -> None:
    async with httpx.AsyncClient(base_url=server.tcp_url, timeout=120) as http:
        body = {
            "cells": ["x = 1", "while True: pass", "print(x)"],
            "cell_timeout": 1,
            "total_timeout": 20,
        }
        r = (await http.post("/run_jupyter", json=body)).json()
        assert r["status"] == "Failed" and r["driver"]["status"] == "TimeLimitExceeded", r
        assert "cells[1]" in r["message"] and "cell_timeout" in r["message"]
        assert len(r["cells"]) == 2  # the cell after it did not run
        # The worker was reset: the next call finds a clean, warm kernel.
        r = (await http.post("/run_jupyter", json={"cells": ["print(2)"]})).json()
        assert r["status"] == "Success" and r["cells"][0]["stdout"] == "2\n", r
