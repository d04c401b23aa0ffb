"""Function calls: the bad-input table, the language table, and the
SandboxFusion mapping (no worker needed)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from corral.api.compat import sandboxfusion as sf
from corral.api.models import FnCallResult, FnCallStage
from corral.errors import InvalidArgument
from corral.node.fncall import languages
from corral.sdk.fncall import call_request

MiB = 1024 * 1024


@pytest.mark.parametrize(
    ("change", "field", "rule_part"),
    [
        ({"language": ""}, "language", "language name"),
        ({"language": "py thon"}, "language", "language name"),
        ({"code": ""}, "code", "must not be empty"),
        ({"code": "   \n"}, "code", "must not be empty"),
        ({"code": "x" * (10 * MiB)}, "code", "at most 4 MiB"),
        ({"run_timeout": -1}, "run_timeout", "above 0"),
        ({"run_timeout": 0}, "run_timeout", "above 0"),
        ({"compile_timeout": 10**6}, "compile_timeout", "at most 300"),
        ({"run_timeout": "soon"}, "run_timeout", "valid number"),
        ({"memory": "1KiB"}, "memory", "between 16MiB and 16GiB"),
        ({"memory": "lots"}, "memory", "size like"),
        ({"output_limit": 0}, "output_limit", "between 1 byte"),
        ({"output_limit": "1GiB"}, "output_limit", "16MiB"),
        ({"files": {"../etc/passwd": "x"}}, "files", "relative paths inside"),
        ({"files": {"a/../../b.txt": "x"}}, "files", "relative paths inside"),
        ({"files": {"/abs": "x"}}, "files", "relative paths inside"),
        ({"files": {"..": "x"}}, "files", "relative paths inside"),
        ({"files": {"": "x"}}, "files", "relative paths inside"),
        ({"files": {"a//b": "x"}}, "files", "relative paths inside"),
        ({"files": {"/".join("d" * 17): "x"}}, "files", "at most 16 parts"),
        ({"files": {"a": "x", "a/b": "y"}}, "files", "a file and a directory"),
        ({"files": {f"f{i}": "x" for i in range(65)}}, "files", "at most 64"),
        ({"files": {"big": b"x" * (65 * MiB)}}, "files", "64 MiB"),
        ({"fetch_files": [""]}, "fetch_files", "file paths"),
        ({"fetch_files": ["out/"]}, "fetch_files", "file paths"),
        ({"fetch_files": ["x" * 1025]}, "fetch_files", "file paths"),
        ({"fetch_files": [f"f{i}" for i in range(65)]}, "fetch_files", "at most 64"),
        ({"stdin": b"\xff" * (17 * MiB)}, "stdin", "16 MiB"),
        ({"image": "not a ref"}, "image", "layer reference"),
    ],
)
def test_bad_calls_name_field_rule_and_value(
    change: dict[str, Any], field: str, rule_part: str
) -> None:
    args: dict[str, Any] = {"language": "python", "code": "print(1)", **change}
    with pytest.raises(InvalidArgument) as exc:
        call_request(**args)
    assert exc.value.field == field
    assert rule_part in exc.value.rule
    assert exc.value.http_status == 400


def test_binary_stdin_and_files_are_data() -> None:
    # Binary input is passed through untouched (a judge feeds bytes).
    req = call_request("python", "print(1)", stdin=b"\x00\xff\xfe", files={"d.bin": b"\x00\x01"})
    assert req.stdin == b"\x00\xff\xfe" and req.files["d.bin"] == b"\x00\x01"


def test_shipped_languages_and_node_overrides(tmp_path: Path) -> None:
    table = languages.load(languages.SHIPPED)
    assert {"python", "bash", "c", "cpp"} <= set(table)
    assert table["python3"] is table["python"] and table["c++"] is table["cpp"]
    assert table["c"].compile is not None and table["python"].compile is None
    extra = tmp_path / "more.toml"
    extra.write_text('[lua]\nsource = "main.lua"\nrun = ["lua5.4", "main.lua"]\n')
    table = languages.load(languages.SHIPPED, extra)
    assert table["lua"].run == ("lua5.4", "main.lua") and "python" in table
    extra.write_text('[c99]\nsource = "m.c"\nrun = ["./m"]\nimage = "gcc:13+tk:1,tk:2"\n')
    assert languages.load(extra)["c99"].image == "gcc:13+tk:1,tk:2"


@pytest.mark.parametrize(
    "body",
    [
        '[x]\nrun = ["a"]\n',  # no source
        '[x]\nsource = "dir/main.x"\nrun = ["a"]\n',
        '[x]\nsource = "m"\nrun = []\n',
        '[x]\nsource = "m"\nrun = ["a"]\ncompile = "cc m"\n',
        "x = 1\n",
        '[x]\nsource = "m"\nrun = ["a"]\nrunn = ["b"]\n',  # a misspelt field
        '[x]\nsource = "m"\nrun = ["a"]\nenv = ["NOEQUALS"]\n',
        '[x]\nsource = "m"\nrun = ["a"]\nprepare = []\n',
        '[x]\nunavailable = ""\n',
        '[x]\nsource = "m"\nrun = ["a"]\nimage = "bad image!"\n',
        '[x]\nsource = "m"\nrun = ["a"]\nimage = "base:1+"\n',
    ],
)
def test_bad_language_entries_are_refused(tmp_path: Path, body: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(body)
    with pytest.raises(InvalidArgument) as exc:
        languages.load(f)
    assert "[x]" in exc.value.field


def test_every_sandboxfusion_cpu_language_is_in_the_table() -> None:
    """SandboxFusion's CPU languages by its own names: each runs, or is
    listed as having no toolchain here, with the reason."""
    table = languages.load(languages.SHIPPED)
    names = [
        "python",
        "pytest",
        "bash",
        "cpp",
        "go",
        "go_test",
        "java",
        "junit",
        "nodejs",
        "typescript",
        "jest",
        "php",
        "csharp",
        "rust",
        "lua",
        "R",
        "perl",
        "D_ut",
        "ruby",
        "scala",
        "julia",
        "kotlin_script",
        "swift",
        "racket",
        "sql",
        "verilog",
        "lean",
    ]
    for name in names:
        lang = table[name]
        assert lang.unavailable or (lang.source and lang.run), name
    assert {n for n in names if table[n].unavailable} == {"julia", "swift", "lean"}
    assert table["js"] is table["nodejs"] and table["ts"] is table["typescript"]
    assert table["jupyter"].prepare is not None  # its kernel is made warm before a call
    assert "GO111MODULE=off" in table["go"].env


def test_sandboxfusion_request_maps_to_a_call() -> None:
    req = sf.RunCodeRequest(
        language="python3",
        code="print(open('in.txt').read())",
        stdin="abc",
        files={"in.txt": base64.b64encode(b"hello").decode(), "skip.txt": None},
        fetch_files=["out.txt"],
        run_timeout=3,
    )
    call = sf.to_call(req)
    assert call.language == "python" and call.stdin == b"abc"
    assert call.files == {"in.txt": b"hello"} and call.fetch_files == ["out.txt"]
    assert call.run_timeout == 3


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"files": {"a.txt": "***not base64***"}}, "files.a.txt"),
        ({"files": {"../x": "aGk="}}, "files"),
        ({"files": {"/abs/x": "aGk="}}, "files"),
        ({"files": {"a/../../x": "aGk="}}, "files"),
        ({"fetch_files": [f"f{i}" for i in range(10_000)]}, "fetch_files"),
        ({"memory_limit_MB": 0}, "memory_limit_MB"),
        ({"run_timeout": -2}, "run_timeout"),
        ({"code": ""}, "code"),
    ],
)
def test_sandboxfusion_bad_input(change: dict[str, Any], field: str) -> None:
    req = sf.RunCodeRequest(**{"language": "python", "code": "print(1)", **change})
    with pytest.raises(InvalidArgument) as exc:
        sf.to_call(req)
    assert exc.value.field == field


def _stage(**kw: Any) -> FnCallStage:
    return FnCallStage(**{"exit_code": 0, **kw})


def test_sandboxfusion_response_statuses() -> None:
    ok = FnCallResult(
        status="ok",
        exit_code=0,
        stdout="1\n",
        stderr="",
        wall_time=0.01,
        cpu_time=0.01,
        peak_memory=1,
        run=_stage(stdout="1\n"),
        files={"o": b"x"},
    )
    r = sf.from_result(ok)
    assert r.status == "Success" and r.run_result is not None and r.compile_result is None
    assert r.run_result.status == "Finished" and r.run_result.return_code == 0
    assert r.files == {"o": "eA=="}
    slow = ok.model_copy(update={"status": "timeout", "run": _stage(timed_out=True, exit_code=-9)})
    r = sf.from_result(slow)
    assert r.status == "Failed" and r.message == "timeout"
    assert r.run_result is not None and r.run_result.status == "TimeLimitExceeded"
    assert r.run_result.return_code is None
    bad = ok.model_copy(
        update={"status": "compile_error", "run": None, "compile": _stage(exit_code=1)}
    )
    r = sf.from_result(bad)
    assert r.run_result is None and r.compile_result is not None
    assert r.compile_result.return_code == 1


def test_sandboxfusion_jupyter_request_maps_to_a_call() -> None:
    req = sf.RunJupyterRequest(
        cells=["a = 1", "print(a)"], cell_timeout=2, total_timeout=20,
        files={"d/x.txt": "aGk="}, fetch_files=["d/y.txt"],
    )  # fmt: skip
    call = sf.to_jupyter_call(req)
    assert call.language == "jupyter" and call.files == {"d/x.txt": b"hi"}
    doc = json.loads(call.code)
    assert doc == {"cells": ["a = 1", "print(a)"], "cell_timeout": 2, "total_timeout": 20}
    assert call.run_timeout == 20 + sf.JUPYTER_SLACK and call.fetch_files == ["d/y.txt"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"cells": []}, "cells"),
        ({"cells": ["x"] * 257}, "cells"),
        ({"kernel": "julia"}, "kernel"),
        ({"total_timeout": 0}, "total_timeout"),
        ({"total_timeout": 10_000}, "total_timeout"),
        ({"cell_timeout": -1}, "cell_timeout"),
        ({"cell_timeout": 50, "total_timeout": 10}, "cell_timeout"),
        ({"files": {"a": "!!"}}, "files.a"),
        ({"files": {"/etc/passwd": "aGk="}}, "files"),
        ({"fetch_files": ["x"] * 65}, "fetch_files"),
        ({"memory_limit_MB": 1}, "memory_limit_MB"),
    ],
)
def test_sandboxfusion_jupyter_bad_input(change: dict[str, Any], field: str) -> None:
    req = sf.RunJupyterRequest(**{"cells": ["print(1)"], **change})
    with pytest.raises(InvalidArgument) as exc:
        sf.to_jupyter_call(req)
    assert exc.value.field == field


def _jupyter_result(doc: object, status: str = "ok") -> FnCallResult:
    out = json.dumps(doc)
    return FnCallResult(
        status=status,  # type: ignore[arg-type]
        exit_code=0, stdout=out, stderr="", wall_time=0.1, cpu_time=0.1, peak_memory=1,
        run=_stage(stdout=out),
    )  # fmt: skip


def test_sandboxfusion_jupyter_response() -> None:
    cell = {"stdout": "1\n", "stderr": "", "display": [], "error": [], "status": "ok"}
    r = sf.from_jupyter_result(_jupyter_result({"status": "Finished", "cells": [cell]}))
    assert r.status == "Success" and r.cells[0].stdout == "1\n"
    assert r.driver is not None and r.driver.stdout == ""  # the cells are not said twice
    late = {"status": "TimeLimitExceeded", "cells": [cell],
            "timed_out": {"cell": 0, "field": "cell_timeout", "limit": 1.0}}  # fmt: skip
    r = sf.from_jupyter_result(_jupyter_result(late))
    assert r.status == "Failed" and "cells[0]" in r.message and "cell_timeout" in r.message
    assert r.driver is not None and r.driver.status == "TimeLimitExceeded"
    r = sf.from_jupyter_result(_jupyter_result("garbage", status="runtime_error"))
    assert r.status == "Failed" and r.message == "runtime_error" and r.cells == []
