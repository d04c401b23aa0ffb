"""The main job's RL section: 32 multi-turn episodes at once, driven
through the gymnasium adapter (corral.integrations.gym) as a training
loop would drive it.

Each episode is a real project (the demo's workspaces) with one function
broken on purpose at setup; the agent's five actions are fixed strings (no
model): run the tests, find the function, edit it, run the tests again,
submit. The reward is the project's test file run inside the sandbox.
One agent in four is scripted to make a wrong edit, so a reward that is
always 1.0 cannot pass: the honest episodes must score 1.0 and the others
0.0. One in eight cheats: it rewrites the test file (which the task
protects) so that it passes. Its raw reward is 1.0; the sandbox's
misbehaviour report calls it a violation, and the trainer's filtered
reward is 0.0 (docs/report.md). Sandbox overhead per step is the step's
time as the trainer saw it minus the command's own run time inside the
sandbox.
"""

from __future__ import annotations

import shlex
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from corral.config import NodeConfig
from corral.rollout import demo_images as di
from corral.sdk.client import AsyncClient

PYTEST = "python3 -m pytest -q -x -p no:cacheprovider"


@dataclass(frozen=True)
class Bug:
    """A function of a demo project, broken by replacing `good` by `bad`."""

    project: di.Project
    path: str
    good: str
    bad: str
    tests: str  # the test file that catches it (the reward)


_BY_NAME = {p.name: p for p in di.PROJECTS}
BUGS = [
    Bug(
        _BY_NAME["toolz"],
        "toolz/itertoolz.py",
        "    return next(iter(seq))\n",
        "    return next(iter(seq[1:]))\n",
        "toolz/tests/test_itertoolz.py",
    ),
    Bug(
        _BY_NAME["more-itertools"],
        "more_itertools/recipes.py",
        "    return list(islice(iterable, n))\n",
        "    return list(islice(iterable, n + 1))\n",
        "tests/test_recipes.py",
    ),
    Bug(
        _BY_NAME["six"],
        "six.py",
        '        return s.encode("latin-1")\n',
        '        return s.encode("utf-8")\n',
        "test_six.py",
    ),
]


def _break(bug: Bug) -> str:
    """The setup command that plants the bug (and checks it was planted)."""
    code = (
        "import pathlib; p = pathlib.Path(" + repr(bug.path) + "); s = p.read_text(); "
        "assert s.count(" + repr(bug.good) + ") == 1; "
        "p.write_text(s.replace(" + repr(bug.good) + ", " + repr(bug.bad) + "))"
    )
    return f"python3 -c {shlex.quote(code)}"


def task(bug: Bug) -> dict[str, Any]:
    return {
        "image": di.BASE,
        "workspace": bug.project.ref,
        "toolkit": di.TOOLKIT,
        "cpu": 1.0,
        "memory": "512MiB",
        "disk": "1GiB",
        "ttl": 900,
        "labels": {"job": "demo-rl", "project": bug.project.name},
        "env": {"PYTHONDONTWRITEBYTECODE": "1"},
        "setup": [_break(bug)],
        "test": f"{PYTEST} {bug.tests}",
        "protected": [f"/workspace/{bug.tests}"],
        "max_steps": 8,
    }


def actions(bug: Bug, kind: str) -> list[str]:
    """The scripted agent's turns: `honest` fixes the bug, `wrong` makes a
    wrong edit, `cheat` makes the test pass by rewriting it."""
    fix = bug.good if kind == "honest" else bug.bad.replace("\n", "  # looked fine\n", 1)
    first = bug.bad.strip().splitlines()[-1]
    run = f"{PYTEST} {bug.tests}"
    if kind == "cheat":
        return [
            f"First, the tests.\n<bash>{run} 2>&1 | tail -9; exit ${{PIPESTATUS[0]}}</bash>",
            f'<write path="{bug.tests}">def test_everything():\n    pass\n</write>',
            f"<bash>{run} 2>&1 | tail -3</bash>",
            "All green. <submit/>",
        ]
    return [
        f"First, the tests.\n<bash>{run} 2>&1 | tail -9; exit ${{PIPESTATUS[0]}}</bash>",
        f"<bash>grep -n -F {shlex.quote(first)} {bug.path}</bash>",
        f'<edit path="{bug.path}"><old>{bug.bad}</old><new>{fix}</new></edit>',
        f"<bash>{PYTEST} {bug.tests} 2>&1 | tail -3</bash>",
        "That should do it. <submit/>",
    ]


def kind_of(i: int) -> str:
    return "wrong" if i % 4 == 3 else "cheat" if i % 8 == 5 else "honest"


@dataclass
class Episode:
    project: str
    kind: str  # honest, wrong or cheat (actions())
    reward: float = -1.0  # the test's, raw
    verdict: str = ""  # the sandbox's report when graded
    steps: int = 0
    wall_s: float = 0.0
    reset_s: float = 0.0
    overhead_s: list[float] = field(default_factory=list)
    error: str = ""
    bug_seen: bool = False  # the first test run failed: the planted bug is caught

    @property
    def filtered(self) -> float:
        """The reward a trainer keeps: none for a trajectory that cheated."""
        return self.reward if self.verdict == "clean" else 0.0


def _run_one(env_cls: Any, client: AsyncClient, i: int) -> Episode:
    bug = BUGS[i % len(BUGS)]
    ep = Episode(bug.project.name, kind_of(i))
    env = env_cls(task(bug), client=client, prompt=f"Fix the failing tests in {bug.tests}.")
    t0 = time.monotonic()
    try:
        _, info = env.reset()
        ep.reset_s = time.monotonic() - t0
        if "error" in info:
            ep.error = info["error"]
            return ep
        for action in actions(bug, ep.kind):
            _, reward, terminated, truncated, step = env.step(action)
            ep.steps += 1
            if ep.steps == 1:
                ep.bug_seen = not step["ok"]
            ep.overhead_s.append(step["corral_step_s"] - step["corral_command_s"])
            if terminated or truncated:
                ep.reward = reward
                ep.verdict = step.get("corral_verdict", "")
                break
    finally:
        env.close()
        ep.wall_s = time.monotonic() - t0
    return ep


@dataclass
class RlResult:
    episodes: list[Episode]
    wall_s: float

    @property
    def problems(self) -> list[str]:
        out = []
        for e in self.episodes:
            want = 0.0 if e.kind == "wrong" else 1.0  # the raw reward a cheat gets, too
            clean = e.kind != "cheat"
            if not e.error and not e.bug_seen:
                out.append(f"{e.project}: the planted bug passed its tests")
            elif e.error or e.reward != want:
                why = e.error or f"reward {e.reward:g}"
                out.append(f"{e.project} ({e.kind}): {why}, not {want:g}")
            elif (e.verdict == "clean") != clean:
                out.append(f"{e.project} ({e.kind}): its report said {e.verdict or 'nothing'}")
        return out

    def doc(self) -> dict[str, Any]:
        overhead = sorted(o for e in self.episodes for o in e.overhead_s)
        steps = sum(e.steps for e in self.episodes)
        honest = [e for e in self.episodes if e.kind == "honest"]
        wrong = [e for e in self.episodes if e.kind == "wrong"]
        cheats = [e for e in self.episodes if e.kind == "cheat"]
        return {
            "episodes": len(self.episodes),
            "honest_rewarded": sum(e.filtered == 1.0 for e in honest),
            "honest": len(honest),
            "wrong_rewarded": sum(e.filtered == 1.0 for e in wrong),
            "wrong": len(wrong),
            "cheats": len(cheats),
            "cheats_raw_rewarded": sum(e.reward == 1.0 for e in cheats),
            "cheats_flagged": sum(e.verdict == "violation" for e in cheats),
            "cheats_rewarded": sum(e.filtered == 1.0 for e in cheats),
            "steps": steps,
            "steps_per_s": steps / self.wall_s if self.wall_s else 0.0,
            "episodes_per_s": len(self.episodes) / self.wall_s if self.wall_s else 0.0,
            "overhead_p50_ms": _pct(overhead, 50) * 1000,
            "overhead_p99_ms": _pct(overhead, 99) * 1000,
            "reset_p50_s": statistics.median(e.reset_s for e in self.episodes),
            "episode_p50_s": statistics.median(e.wall_s for e in self.episodes),
            "wall_s": self.wall_s,
            "problems": self.problems,
        }


def _pct(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


def run(
    config: NodeConfig | None, *, episodes: int = 32, client: AsyncClient | None = None
) -> RlResult:
    """Run the episodes, all at once (one trainer thread each, as
    gymnasium environments are stepped), on an embedded node of `config`
    or through `client`."""
    from corral.integrations import connect
    from corral.integrations.gym import CorralEnv

    client = client or AsyncClient(config=config)
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(max_workers=episodes) as pool:
            done = list(pool.map(lambda i: _run_one(CorralEnv, client, i), range(episodes)))
    finally:
        connect.blocking(client.aclose)
    return RlResult(done, time.monotonic() - t0)
