"""Corral's framework adapters (corral.integrations), each driven by the
real framework from PyPI in its own virtual environment (made by the
install script): verl, skyrl-gym and gymnasium in .venv-rl, the OpenAI
Agents SDK in .venv-agents. Each script runs scripted multi-turn episodes
through the framework's own entry points against `corral serve` (see
tests/integration/rl_adapters/), and checks the node afterwards: no
sandbox of the test is left open."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

import corral

from ..framework import Server
from ..framework.images import require_image

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).parent / "rl_adapters"
VENVS = {
    "verl": ".venv-rl",
    "verl_run": ".venv-rl",
    "skyrl": ".venv-rl",
    "gym": ".venv-rl",
    "agents": ".venv-agents",
}

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("framework", sorted(VENVS))
def test_the_framework_drives_scripted_episodes_on_corral(server: Server, framework: str) -> None:
    require_image("debian-python:bookworm")
    python = ROOT / VENVS[framework] / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{python} is missing: ./scripts/install.sh makes it")
    label = f"rl-{framework}"
    env = {**os.environ, "CORRAL_URL": server.url, "RL_LABEL": label,
           "VERL_USE_EXTERNAL_PLUGINS": "none", "HOME": str(server.sock.parent)}  # fmt: skip
    done = subprocess.run([str(python), str(SCRIPTS / f"{framework}_episode.py")], env=env,
                          capture_output=True, text=True, timeout=600, cwd=server.sock.parent)  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "RESULT: PASS" in done.stdout

    async def left() -> list[str]:
        async with corral.AsyncClient(server.url) as c:
            return [s.id for s in await c.sandboxes.list({"test": label})]

    assert asyncio.run(left()) == []  # checked here too, not only by the script
