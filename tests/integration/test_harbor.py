"""harbor (from PyPI, its own CLI, unmodified) runs the terminal-bench-format
tasks of tests/integration/tasks/ with its oracle agent on Corral, through
Corral's environment provider (corral.integrations.harbor), against
`corral serve`: each right solution scores 1.0, the wrong one 0.0; then 35
trials at once. harbor needs Python 3.12 (.venv-harbor, made by the
install script where one is found)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from ..framework import Server
from ..framework.images import require_image

ROOT = Path(__file__).resolve().parents[2]
HARBOR = ROOT / ".venv-harbor" / "bin" / "harbor"
TASKS = Path(__file__).parent / "tasks"
WANT = {"apt-jq": 1.0, "fix-python": 1.0, "hello-file": 1.0, "json-report": 1.0,
        "wrong-solution": 0.0}  # fmt: skip

pytestmark = pytest.mark.slow


def _python312() -> bool:
    """Whether a Python >= 3.12 runs here (where the install script looks)."""
    found = [shutil.which(n) for n in ("python3.12", "python3.13")]
    found += [str(p) for p in Path("/root/.pyenv/versions").glob("3.1[2-9]*/bin/python3.1*")]
    for c in filter(None, found):
        ok = subprocess.run([c, "-c", "import sys; assert sys.version_info >= (3, 12)"],
                            capture_output=True)  # fmt: skip
        if ok.returncode == 0:
            return True
    return False


def _run(server: Server, jobs: Path, name: str, *extra: str) -> dict[str, list[float]]:
    if not HARBOR.exists():
        if not _python312():
            pytest.skip("harbor needs Python >= 3.12, which this machine does not have")
        pytest.fail(f"{HARBOR} is missing: ./scripts/install.sh makes it")
    env = {**os.environ, "CORRAL_URL": server.url, "HOME": str(jobs)}
    done = subprocess.run(
        [str(HARBOR), "run", "-p", str(TASKS), "-a", "oracle",
         "-e", "corral.integrations.harbor:CorralEnvironment", "-o", str(jobs),
         "--job-name", name, *extra],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rewards: dict[str, list[float]] = {}
    for result in (jobs / name).glob("*/result.json"):
        doc = json.loads(result.read_text())
        assert doc.get("exception_info") is None, doc.get("exception_info")
        reward = float(((doc.get("verifier_result") or {}).get("rewards") or {})["reward"])
        rewards.setdefault(doc["task_name"], []).append(reward)
    return rewards


def test_harbor_runs_the_tasks_on_corral(server: Server, tmp_path: Path) -> None:
    require_image("debian-python:bookworm")
    rewards = _run(server, tmp_path, "oracle", "-n", "5")
    assert {k: v for k, (v,) in rewards.items()} == WANT


def test_harbor_runs_35_trials_at_once(server: Server, tmp_path: Path) -> None:
    require_image("debian-python:bookworm")
    t0 = time.monotonic()
    rewards = _run(server, tmp_path, "burst", "-n", "35", "-k", "7")
    wall = time.monotonic() - t0
    assert sum(len(v) for v in rewards.values()) == 35
    assert {k: set(v) for k, v in rewards.items()} == {k: {v} for k, v in WANT.items()}
    print(f"harbor: 35 trials at once on Corral, {wall:.1f} s to the last result")
