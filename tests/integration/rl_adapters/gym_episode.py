"""gymnasium 1.4.0 drives Corral: the environment made with gymnasium.make,
checked by gymnasium's own env checker where it applies, and stepped to
the end with text actions; the right agent scores 1.0, the wrong 0.0."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import gymnasium

from corral.integrations import gym as corral_gym

sys.path.insert(0, str(Path(__file__).parent))
from task import RIGHT, TASK, WRONG, as_text, check_left_open, report

corral_gym.register()
URL = os.environ["CORRAL_URL"]


def episode(env: gymnasium.Env, actions: list[dict]) -> tuple[list[tuple], list[float]]:
    obs, info = env.reset(seed=1)
    assert obs == "Fix add() in calc.py." and info == {}, (obs, info)
    steps, times = [], []
    for action in actions:
        t0 = time.perf_counter()
        steps.append(env.step(as_text(action)))
        times.append(time.perf_counter() - t0)
        if steps[-1][2] or steps[-1][3]:
            break
    return steps, times


env = gymnasium.make(corral_gym.ENV_ID, task=TASK, url=URL, prompt="Fix add() in calc.py.")
assert env.observation_space.contains("any text, even ünicode ✓")
steps, times = episode(env, RIGHT)
obs, reward, terminated, truncated, _ = steps[-1]
assert (reward, terminated, truncated) == (1.0, True, False), steps
assert "passed" in steps[3][0], steps[3]
wrong, _ = episode(env, WRONG)  # reset() closed the first episode's sandbox
assert wrong[-1][1:4] == (0.0, True, False), wrong[-1]
# The step limit: truncated, still graded.
short = gymnasium.make(corral_gym.ENV_ID, task={**TASK, "max_steps": 2}, url=URL,
                       prompt="Fix add() in calc.py.")  # fmt: skip
out, _ = episode(short, [{"command": "true"}] * 3)
assert len(out) == 2 and out[-1][1:4] == (0.0, False, True), out
short.close()
# After the end: an observation that says so, never an exception.
after = env.step("<bash>ls</bash>")
assert after[2] and "over" in after[0], after
env.close()

# An image the node lacks: the first observation says why, the loop goes on.
bad = gymnasium.make(corral_gym.ENV_ID, task={**TASK, "image": "no-such:image"}, url=URL)
obs, info = bad.reset()
assert obs.startswith("error: the sandbox could not start") and "no-such" in obs, obs
assert bad.step("<bash>ls</bash>")[2], "a failed episode must end at its first step"
bad.close()

# A bad task is refused by field name when the env is made.
try:
    gymnasium.make(corral_gym.ENV_ID, task={**TASK, "max_steps": 0}, url=URL)
except Exception as exc:
    assert "max_steps" in str(exc), exc
else:
    raise AssertionError("max_steps=0 was accepted")

check_left_open()
report(step_s=times)
