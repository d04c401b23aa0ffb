"""skyrl-gym 0.4.0 drives Corral: the environment registered with
skyrl_gym.envs.register, made with skyrl_gym.make as SkyRL's generator
makes it (env_config, extras with max_turns), stepped with the model's
text until done; the right agent scores 1.0, the wrong one 0.0."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import skyrl_gym

from corral.integrations import skyrl

sys.path.insert(0, str(Path(__file__).parent))
from task import RIGHT, TASK, WRONG, as_text, check_left_open, report

skyrl.register()
skyrl.register()  # twice: a no-op
CONFIG = {"url": os.environ["CORRAL_URL"], **TASK}
PROMPT = [{"role": "user", "content": "Fix add() in calc.py so that test_calc.py passes."}]


def episode(actions: list[dict], **extras: object) -> tuple[list[dict], list[float]]:
    env = skyrl_gym.make("corral", env_config=CONFIG, extras={"max_turns": 5, **extras})
    obs, _ = env.init(PROMPT)
    assert obs == PROMPT
    outs, times = [], []
    for action in actions:
        t0 = time.perf_counter()
        out = env.step(as_text(action))
        times.append(time.perf_counter() - t0)
        outs.append(out)
        if out["done"]:
            break
    metrics = env.get_metrics()
    env.close()
    return outs, times, metrics


outs, times, metrics = episode(RIGHT)
assert [o["done"] for o in outs] == [False, False, False, False, True], outs
assert "AssertionError" in outs[0]["observations"][0]["content"]
assert "passed" in outs[3]["observations"][0]["content"]  # the edit persisted
assert outs[-1]["reward"] == 1.0 and outs[-1]["observations"] == [], outs[-1]
assert metrics["steps"] == 4 and metrics["reward"] == 1.0, metrics

wrong, _, _ = episode(WRONG)
assert wrong[-1]["done"] and wrong[-1]["reward"] == 0.0, wrong[-1]

# Out of turns without submitting: graded at the last turn.
limited, _, _ = episode([*RIGHT[:4], {"command": "true"}], corral={"max_steps": 4})
assert limited[3]["done"] and limited[3]["reward"] == 1.0, limited[3]

# The model's mistakes are observations; a step after the end says so.
env = skyrl_gym.make("corral", env_config=CONFIG, extras={"max_turns": 5})
env.init(PROMPT)
out = env.step("I think I should look around first.")
assert not out["done"] and "no action found" in out["observations"][0]["content"], out
out = env.step('<read path="missing.txt"/>')
assert out["observations"][0]["content"].startswith("error:"), out
env.close()
out = env.step("<bash>ls</bash>")
assert out["done"] and "closed" in out["metadata"]["observation"], out

# An image the node lacks: the episode ends at once, the trainer goes on.
env = skyrl_gym.make("corral", env_config={**CONFIG, "image": "no-such:image"}, extras={})
env.init(PROMPT)
out = env.step("<bash>ls</bash>")
assert out["done"] and "no-such" in out["metadata"]["error"], out
env.close()

# A config with a typo is refused by name when the env is made.
try:
    skyrl_gym.make("corral", env_config={**CONFIG, "imgae": "x"}, extras={})
except Exception as exc:  # skyrl_gym.make re-raises the constructor's error
    assert "imgae" in str(exc), exc
else:
    raise AssertionError("a misspelt field was accepted")

check_left_open()
report(step_s=times)
