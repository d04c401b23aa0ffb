"""A task in harbor's (terminal-bench's) format, read from its directory:

task.toml             [agent] / [verifier] timeout_sec, [environment]
                      cpus, memory_mb, storage_mb, network_mode
                      ("public", "no-network", "allowlist" with
                      allowed_hosts; the older allow_internet), workdir
instruction.md        what the agent is asked
environment/Dockerfile   the sandbox's image, built by Corral
solution/solve.sh     the reference solution (the oracle agent runs it)
tests/test.sh         the verifier: writes /logs/verifier/reward.txt
                      (a number) or reward.json (numbers by name)
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.errors import InvalidArgument

LOGS = ("/logs/agent", "/logs/verifier", "/logs/artifacts")
TESTS, SOLUTION = "/tests", "/solution"
REWARD_TXT, REWARD_JSON = "/logs/verifier/reward.txt", "/logs/verifier/reward.json"


@dataclass(frozen=True)
class Task:
    path: Path
    name: str
    instruction: str
    agent_timeout: float = 900.0
    verifier_timeout: float = 900.0
    build_timeout: float = 600.0
    cpus: float = 1.0
    memory_mb: int = 2048
    storage_mb: int = 10240
    network_mode: str = "public"  # public, no-network, allowlist
    allowed_hosts: list[str] = field(default_factory=list)
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    solution_env: dict[str, str] = field(default_factory=dict)

    @property
    def dockerfile(self) -> Path:
        return self.path / "environment" / "Dockerfile"

    @property
    def image_tag(self) -> str:
        safe = "".join(c if c.isalnum() or c in "._-" else "-" for c in self.name.lower())
        return f"task-{safe.strip('-.')[:100] or 'task'}:latest"

    @property
    def has_solution(self) -> bool:
        return (self.path / "solution" / "solve.sh").is_file()


def _section(doc: dict[str, Any], name: str) -> dict[str, Any]:
    got = doc.get(name, {})
    if not isinstance(got, dict):
        raise InvalidArgument(f"task.toml.{name}", "must be a table", got)
    return got


def _number(section: dict[str, Any], key: str, where: str, default: float) -> float:
    value = section.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise InvalidArgument(f"task.toml.{where}.{key}", "must be a positive number", value)
    return float(value)


def is_task(path: Path) -> bool:
    return (path / "task.toml").is_file() and (path / "tests" / "test.sh").is_file()


def load(path: Path) -> Task:
    """The task at `path`, checked: a missing file or a bad field is named."""
    if not path.is_dir():
        raise InvalidArgument("task", "must be a task directory", str(path))
    for rel in ("task.toml", "instruction.md", "environment/Dockerfile", "tests/test.sh"):
        if not (path / rel).is_file():
            raise InvalidArgument("task", f"must have {rel}", str(path))
    try:
        doc = tomllib.loads((path / "task.toml").read_text())
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument("task.toml", f"must be valid TOML: {exc}", str(path)) from None
    agent, verifier = _section(doc, "agent"), _section(doc, "verifier")
    env, solution = _section(doc, "environment"), _section(doc, "solution")
    mode = env.get("network_mode")
    if mode is None:
        mode = "public" if env.get("allow_internet", True) else "no-network"
    if mode not in ("public", "no-network", "allowlist"):
        raise InvalidArgument("task.toml.environment.network_mode",
                              "must be public, no-network or allowlist", mode)  # fmt: skip
    hosts = env.get("allowed_hosts", [])
    if not isinstance(hosts, list) or not all(isinstance(h, str) for h in hosts):
        raise InvalidArgument("task.toml.environment.allowed_hosts", "must list host names",
                              hosts)  # fmt: skip
    memory = env.get("memory_mb")
    if memory is None and isinstance(env.get("memory"), str):  # the older "2G"
        text = env["memory"].strip().upper().removesuffix("B")
        scale = {"G": 1024, "M": 1}.get(text[-1:], 0)
        memory = int(float(text[:-1]) * scale) if scale else None
    return Task(
        path=path.resolve(),
        name=str((_section(doc, "metadata").get("name")) or path.resolve().name),
        instruction=(path / "instruction.md").read_text(),
        agent_timeout=_number(agent, "timeout_sec", "agent", 900),
        verifier_timeout=_number(verifier, "timeout_sec", "verifier", 900),
        build_timeout=_number(env, "build_timeout_sec", "environment", 600),
        cpus=_number(env, "cpus", "environment", 1),
        memory_mb=int(_number({"memory_mb": memory or 2048}, "memory_mb", "environment", 2048)),
        storage_mb=int(_number(env, "storage_mb", "environment", 10240)),
        network_mode=mode,
        allowed_hosts=hosts,
        workdir=env.get("workdir"),
        env={str(k): str(v) for k, v in (env.get("env") or {}).items()},
        solution_env={str(k): str(v) for k, v in (solution.get("env") or {}).items()},
    )


def discover(path: Path) -> list[Task]:
    """A task directory, or a directory of them."""
    if is_task(path):
        return [load(path)]
    found = [load(p) for p in sorted(path.iterdir()) if p.is_dir() and is_task(p)]
    if not found:
        raise InvalidArgument("tasks", "must be a task directory or a directory of them",
                              str(path))  # fmt: skip
    return found
