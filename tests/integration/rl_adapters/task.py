"""The task the adapters' scripted episodes share: a function with a bug,
its test as the reward, and the five fixed actions that fix it (or, for
the wrong agent, that do not)."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

IMAGE = "debian-python:bookworm"
LABEL = os.environ.get("RL_LABEL", "rl-adapters")

TASK: dict[str, Any] = {
    "image": IMAGE,
    "labels": {"test": LABEL},
    # A fix of the same size within the second of the failing run would
    # otherwise be hidden by the stale .pyc (it checks mtime and size).
    "env": {"PYTHONDONTWRITEBYTECODE": "1"},
    "setup": [
        "printf 'def add(a, b):\\n    return a - b\\n' > calc.py",
        "printf 'from calc import add\\nassert add(2, 3) == 5, add(2, 3)\\nprint(\"passed\")\\n'"
        " > test_calc.py",
    ],
    "test": "python3 test_calc.py",
    "max_steps": 10,
}

# Five steps; state carries across them (the shell's files, the edit).
RIGHT: list[dict[str, Any]] = [
    {"command": "python3 test_calc.py"},
    {"path": "calc.py"},
    {"path": "calc.py", "old": "a - b", "new": "a + b"},
    {"command": "python3 test_calc.py && echo marker > done.txt"},
    {"submit": True},
]
WRONG: list[dict[str, Any]] = [
    {"command": "python3 test_calc.py"},
    {"path": "calc.py"},
    {"path": "calc.py", "content": "def add(a, b):\n    return a * b\n"},
    {"command": "python3 test_calc.py"},
    {"submit": True},
]


def as_text(action: dict[str, Any]) -> str:
    """The same action as a text model writes it (SkyRL, gymnasium)."""
    if "submit" in action:
        return "I am done. <submit/>"
    if "command" in action:
        return f"Let me run it.\n<bash>{action['command']}</bash>"
    if "old" in action:
        return (f'<edit path="{action["path"]}"><old>{action["old"]}</old>'
                f'<new>{action["new"]}</new></edit>')  # fmt: skip
    if "content" in action:
        return f'<write path="{action["path"]}">{action["content"]}</write>'
    return f'<read path="{action["path"]}"/>'


async def left_open(label: str = LABEL) -> list[str]:
    """Sandboxes of this test still live on the node."""
    import corral

    async with corral.AsyncClient(os.environ["CORRAL_URL"]) as c:
        return [s.id for s in await c.sandboxes.list({"test": label})]


def report(**stats: Any) -> None:
    print("STATS: " + json.dumps(stats))
    print("RESULT: PASS")


def check_left_open() -> None:
    left = asyncio.run(left_open())
    assert not left, f"sandboxes left open: {left}"
