"""One adapter's steps next to the SDK's, timed in the framework's own
process: run in that framework's virtual environment by bench/adapters.py.

    python steps.py FRAMEWORK N     (CORRAL_URL names the server)

A step is the command `true` through the adapter's own entry point; each
is followed by the same command sent straight through Corral's SDK to the
same sandbox (the baseline: what a user without the adapter would call),
so the pairs share the process, the sandbox and the moment. Prints both
series (after a warm-up) as one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

URL = os.environ["CORRAL_URL"]
TASK: dict[str, Any] = {"image": "debian-python:bookworm", "max_steps": 10_000,
                        "labels": {"bench": "adapters"}}  # fmt: skip
WARMUP = 20
Series = tuple[list[float], list[float]]


def paired(n: int, step: Callable[[], Any], sdk: Callable[[], Any]) -> Series:
    ours: list[float] = []
    theirs: list[float] = []
    for i in range(n + WARMUP):
        for fn, out in ((step, ours), (sdk, theirs)):
            t0 = time.perf_counter()
            fn()
            if i >= WARMUP:
                out.append(time.perf_counter() - t0)
    return ours, theirs


async def apaired(
    n: int, step: Callable[[], Awaitable[Any]], sdk: Callable[[], Awaitable[Any]]
) -> Series:
    ours: list[float] = []
    theirs: list[float] = []
    for i in range(n + WARMUP):
        for fn, out in ((step, ours), (sdk, theirs)):
            t0 = time.perf_counter()
            await fn()
            if i >= WARMUP:
                out.append(time.perf_counter() - t0)
    return ours, theirs


def verl(n: int) -> Series:
    from verl.experimental.agent_loop.tool_agent_loop import AgentData, ToolAgentLoop
    from verl.experimental.agent_loop.tool_parser import FunctionCall

    from corral.integrations.verl import CorralSandboxTool

    async def main() -> Series:
        tool = CorralSandboxTool({"type": "native", "url": URL, **TASK})
        loop = object.__new__(ToolAgentLoop)
        loop.tools = {tool.name: tool}
        loop.max_tool_response_length = 4096
        loop.tool_response_truncate_side = "middle"
        data = AgentData(messages=[], image_data=[], video_data=[], audio_data=None,
                         mm_processor_kwargs=None, metrics={}, request_id="bench",
                         tools_kwargs={})  # fmt: skip
        call = FunctionCall(name="sandbox", arguments='{"command": "true"}')
        try:
            await loop._call_tool(call, {}, data)  # starts the trajectory's sandbox
            sbx = tool._episodes["bench"].sandbox
            return await apaired(
                n, lambda: loop._call_tool(call, {}, data), lambda: sbx.commands.run("true")
            )
        finally:
            await tool.aclose()

    return asyncio.run(main())


def skyrl(n: int) -> Series:
    import skyrl_gym

    from corral.integrations import skyrl as adapter
    from corral.integrations.connect import blocking

    adapter.register()
    env = skyrl_gym.make("corral", env_config={"url": URL, **TASK}, extras={})
    env.init([{"role": "user", "content": "bench"}])
    sbx = env.episode.sandbox
    try:
        return paired(n, lambda: env.step("<bash>true</bash>"),
                      lambda: blocking(sbx.commands.run, "true"))  # fmt: skip
    finally:
        env.close()


def gym(n: int) -> Series:
    import gymnasium

    from corral.integrations import gym as adapter
    from corral.integrations.connect import blocking

    adapter.register()
    env = gymnasium.make(adapter.ENV_ID, task=TASK, url=URL)
    env.reset()
    sbx = env.unwrapped.episode.sandbox
    try:
        return paired(n, lambda: env.step("<bash>true</bash>"),
                      lambda: blocking(sbx.commands.run, "true"))  # fmt: skip
    finally:
        env.close()


def agents(n: int) -> Series:
    from agents.sandbox import Manifest
    from agents.sandbox.snapshot import NoopSnapshotSpec

    from corral.integrations.openai_agents import CorralSandboxClient, CorralSandboxOptions

    async def main() -> Series:
        client = CorralSandboxClient(URL)
        options = CorralSandboxOptions(image=TASK["image"], labels=TASK["labels"])
        session = await client.create(manifest=Manifest(), options=options,
                                      snapshot=NoopSnapshotSpec())  # fmt: skip
        await session.start()
        sbx = session._inner.sandbox
        root = str(session.state.manifest.root)
        try:
            # The SDK's exec with its shell off sends the argv ["true"] in the root.
            return await apaired(n, lambda: session.exec("true", shell=False),
                                 lambda: sbx.commands.run(["true"], cwd=root))  # fmt: skip
        finally:
            await client.delete(session)
            await client.corral.aclose()

    return asyncio.run(main())


if __name__ == "__main__":
    framework, count = sys.argv[1], int(sys.argv[2])
    ours, sdk = globals()[framework](count)
    print(json.dumps({"framework": framework, "adapter_s": ours, "sdk_s": sdk}))
