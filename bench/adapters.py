"""The framework adapters' cost per step, next to Corral's own SDK in the
same run, and the RL batch's episodes/s.

    corral bench adapters [--steps N] [--rounds R] [--episodes E]

One `corral serve`; every client reaches it over the same HTTP transport.
A step is the command `true` in a live sandbox, through:
  - verl 0.9.1: ToolAgentLoop's own `_call_tool` on CorralSandboxTool;
  - skyrl-gym 0.4.0: `env.step("<bash>true</bash>")`;
  - gymnasium 1.4.0: `env.step("<bash>true</bash>")`;
  - the OpenAI Agents SDK 0.24: `session.exec("true", shell=False)`;
each framework in its own virtual environment (.venv-rl, .venv-agents),
after a warm-up of 20 steps. Each adapter step is paired with the same
command sent through Corral's SDK to the same sandbox from the same
process right after it (bench/adapters/steps.py): the SDK call a user
would make without the adapter (for the blocking frameworks, through the
same private loop the blocking SDK uses). Added cost is the difference of
the medians. Then the demo's RL batch (rollout/rl_demo.py: 32 episodes at
once through the gymnasium adapter) runs on the same server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import IMAGES, fresh_dir, median, pct, serve, table, wait_up, write_result
from corral.images.store import ImageStore
from corral.progress import progress_bar
from corral.rollout import demo_images as di
from corral.rollout import rl_demo
from corral.sdk.client import AsyncClient

ROOT = Path(__file__).resolve().parents[1]
DATA = Path("/var/lib/corral-adapters-bench")
STEPS = Path(__file__).resolve().parent / "adapters" / "steps.py"
PATHS = {"verl": ".venv-rl", "skyrl": ".venv-rl", "gym": ".venv-rl", "agents": ".venv-agents"}
LABEL = {
    "verl": "verl `ToolAgentLoop._call_tool` → CorralSandboxTool",
    "skyrl": 'skyrl-gym `env.step("<bash>true</bash>")`',
    "gym": 'gymnasium `env.step("<bash>true</bash>")`',
    "agents": 'Agents SDK `session.exec("true", shell=False)`',
}


def adapter(url: str, framework: str, n: int) -> tuple[list[float], list[float]]:
    python = ROOT / PATHS[framework] / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"{python} is missing: ./scripts/install.sh makes it")
    env = {**os.environ, "CORRAL_URL": url, "VERL_USE_EXTERNAL_PLUGINS": "none"}
    done = subprocess.run([str(python), str(STEPS), framework, str(n)], env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"{framework}: {done.stderr[-2000:]}")
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    return list(doc["adapter_s"]), list(doc["sdk_s"])


def ms(s: float) -> str:
    return f"{s * 1000:.2f} ms"


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200, help="steps per path per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--episodes", type=int, default=32)
    args = ap.parse_args()

    with progress_bar() as progress:
        di.ensure_all(ImageStore(IMAGES), DATA.parent / "corral-adapters-sdists", progress)
    proc, url = serve(fresh_dir(DATA))
    try:
        await wait_up(url)
        samples: dict[str, tuple[list[float], list[float]]] = {}
        for r in range(args.rounds):
            for framework in PATHS:
                print(f"round {r + 1}: {framework}", flush=True)
                ours, sdk = await asyncio.to_thread(adapter, url, framework, args.steps)
                got = samples.setdefault(framework, ([], []))
                got[0].extend(ours)
                got[1].extend(sdk)
        print(f"RL batch: {args.episodes} episodes", flush=True)
        batch = (await asyncio.to_thread(
            rl_demo.run, None, episodes=args.episodes, client=AsyncClient(url)
        )).doc()  # fmt: skip
    finally:
        proc.terminate()
        proc.wait()

    rows = []
    for name, (ours, sdk) in samples.items():
        added = median(ours) - median(sdk)
        rows.append([LABEL[name], str(len(ours)), ms(median(ours)), ms(pct(ours, 99)),
                     ms(median(sdk)), ms(pct(sdk, 99)), f"{added * 1000:+.2f} ms",
                     f"{median(ours) / median(sdk):.2f}x"])  # fmt: skip
    steps = table(["adapter step", "steps", "p50", "p99", "SDK p50", "SDK p99",
                   "added p50", "ratio"], rows)  # fmt: skip
    b = batch
    batch_table = table(
        ["episodes", "honest rewarded", "wrong rewarded", "steps", "steps/s", "episodes/s",
         "overhead/step p50", "p99", "reset p50", "episode p50", "wall"],
        [[str(b["episodes"]), f"{b['honest_rewarded']}/{b['honest']}",
          f"{b['wrong_rewarded']}/{b['wrong']}", str(b["steps"]), f"{b['steps_per_s']:.1f}",
          f"{b['episodes_per_s']:.2f}", f"{b['overhead_p50_ms']:.2f} ms",
          f"{b['overhead_p99_ms']:.1f} ms", f"{b['reset_p50_s']:.2f} s",
          f"{b['episode_p50_s']:.1f} s", f"{b['wall_s']:.1f} s"]],
    )  # fmt: skip
    path = write_result(
        "adapters",
        "Framework adapters: cost per step next to the SDK, and the RL batch",
        [
            "## One step (`true`), one at a time, next to the SDK's call\n\n"
            f"{args.rounds} rounds of {args.steps} pairs per adapter. The SDK columns are the "
            "same command sent through Corral's SDK right after each adapter step, from the "
            "same process to the same sandbox.\n\n" + steps,
            "## The RL batch: 32 episodes at once through the gymnasium adapter\n\n"
            "The demo's task (rollout/rl_demo.py): a bug planted in a real project, five "
            "scripted steps, the project's test file as reward; one agent in four makes a "
            "wrong edit. Overhead per step is the step's time as the trainer saw it minus "
            "the command's own run time in the sandbox.\n\n"
            + batch_table
            + ("\n\nProblems: " + "; ".join(b["problems"]) if b["problems"] else ""),
        ],
    )
    print(path.read_text())


if __name__ == "__main__":
    asyncio.run(main())
