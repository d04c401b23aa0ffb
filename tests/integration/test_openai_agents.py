"""The OpenAI Agents SDK's E2B sandbox client (openai-agents[e2b] from PyPI,
unmodified) runs a scripted agent against `corral serve`, configured by the
E2B environment variables only. It has a virtual environment of its own
(.venv-agents, made by the install script): it pins e2b 2.31, and the
stock-SDK tests use e2b 2.45."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ..framework import Server
from ..framework.images import require_image

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-agents" / "bin" / "python"
SCRIPT = Path(__file__).parent / "agents_e2b" / "scripted_agent.py"


def test_a_scripted_openai_agent_runs_on_corral_through_e2b(server: Server) -> None:
    require_image("e2b-user:bookworm")
    require_image("e2b-tools:bookworm")
    if not PYTHON.exists():
        pytest.fail(f"{PYTHON} is missing: the install script makes it (openai-agents[e2b])")
    url = server.tcp_url
    env = {**os.environ, "E2B_API_URL": url, "E2B_SANDBOX_URL": url, "E2B_API_KEY": "e2b_00",
           "E2B_VALIDATE_API_KEY": "false", "E2B_DOMAIN": "corral.local"}  # fmt: skip
    env.pop("E2B_DEBUG", None)
    done = subprocess.run([str(PYTHON), str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "RESULT: PASS" in done.stdout
