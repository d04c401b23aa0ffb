"""verl's SandboxFusion reward function (its `compute_score`, verl 0.7.0)
against `corral serve`, on a sample of problems: stdin/stdout test cases,
call-based ones (`fn_name`), partial credit, a wrong answer, a crash and a
solution that never ends.

The module is verl's own code, loaded from verl's wheel (the install
script downloads it): verl's package __init__ imports torch, which this
reward path does not use, so the two files of
verl/utils/reward_score/sandbox_fusion are loaded as a package of their own.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import threading
import types
import zipfile
from pathlib import Path
from typing import Any

import pytest

from ..framework import Server

WHEEL = Path(__file__).resolve().parents[2] / "build/peers/verl-0.7.0-py3-none-any.whl"
PKG = "verl/utils/reward_score/sandbox_fusion"


def _verl_reward(tmp: Path) -> types.ModuleType:
    assert WHEEL.exists(), f"{WHEEL} is missing: the install script downloads it"
    with zipfile.ZipFile(WHEEL) as z:
        for name in ("__init__.py", "utils.py"):
            (tmp / name).write_bytes(z.read(f"{PKG}/{name}"))
    spec = importlib.util.spec_from_file_location(
        "verl_sandbox_fusion", tmp / "__init__.py", submodule_search_locations=[str(tmp)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
CASES = {"inputs": ["1 2\n", "10 20\n", "-5 5\n"], "outputs": ["3\n", "30\n", "0\n"]}


def _scores(url: str, reward: types.ModuleType) -> dict[str, tuple[float, list[Any]]]:
    gate = threading.Semaphore(4)

    def score(completion: str, cases: dict[str, Any], **kw: Any) -> tuple[float, list[Any]]:
        s, meta = reward.compute_score(url, gate, 512, completion, dict(cases), **kw)
        return s, meta

    wrong_on_one = (
        "```python\na, b = map(int, input().split())\nprint(a + b if a != 10 else 7)\n```"
    )
    # One JSON argument a line, as verl feeds a call-based problem.
    call_based = {"fn_name": "add", "inputs": ["1\n2", "3\n4"], "outputs": ["3", "7"]}
    return {
        "right": score(ADD, CASES),
        "partial": score(wrong_on_one, CASES),
        "wrong": score("```python\nprint(42)\n```", CASES),
        "crash": score("```python\nraise SystemExit(1)\n```", CASES),
        "slow": score("```python\nwhile True: pass\n```", CASES, timeout=2),
        "no_code": score("I think the answer is 3.", CASES),
        "call_based": score("```python\ndef add(a, b):\n    return a + b\n```", call_based),
    }


@pytest.mark.timeout(600)
async def test_verl_compute_score_against_corral(server: Server, tmp_path: Path) -> None:
    reward = _verl_reward(tmp_path)
    got = await asyncio.to_thread(_scores, f"{server.tcp_url}/run_code", reward)
    assert got["right"][0] == 1.0, got["right"]
    assert got["partial"][0] == pytest.approx(2 / 3), got["partial"]
    assert got["wrong"][0] == 0.0 and got["crash"][0] == 0.0
    assert got["slow"][0] == 0.0
    assert got["no_code"][0] == 0.0
    assert got["call_based"][0] == 1.0, got["call_based"]
    # Corral's own words reach verl's metadata: a time-out is told as one.
    slow_meta = got["slow"][1][0]
    assert "timeout" in str(slow_meta).lower() or "TimeLimitExceeded" in str(slow_meta)
