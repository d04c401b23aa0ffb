"""verl 0.9.1 drives Corral: the tools load through verl's own registry
from a tool config file, and every call goes through ToolAgentLoop's own
_call_tool (create, execute, release around each call, its JSON checks,
its truncation), as a multi-turn rollout does. Two trajectories run at
once: the right agent scores 1.0, the wrong one 0.0."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from verl.experimental.agent_loop.tool_agent_loop import AgentData, ToolAgentLoop
from verl.experimental.agent_loop.tool_parser import FunctionCall
from verl.tools.tool_registry import initialize_tools_from_config

sys.path.insert(0, str(Path(__file__).parent))
from task import LABEL, RIGHT, TASK, WRONG, check_left_open, report

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "verl"
# One dataset row's task, as verl hands it to the tool: extra_info.tools_kwargs.
ROW = {"sandbox": {"create_kwargs": {k: v for k, v in TASK.items() if k != "image"}}}


def loop_over(tools: list[Any], cls: type[ToolAgentLoop] = ToolAgentLoop) -> ToolAgentLoop:
    # The loop's own tool dispatch, without a model server behind it.
    loop = object.__new__(cls)
    loop.tools = {t.name: t for t in tools}
    loop.max_tool_response_length = 4096
    loop.tool_response_truncate_side = "middle"
    return loop


def agent_data(request_id: str, tools_kwargs: dict[str, Any] | None = None) -> AgentData:
    return AgentData(messages=[], image_data=[], video_data=[], audio_data=None,
                     mm_processor_kwargs=None, metrics={}, request_id=request_id,
                     tools_kwargs=tools_kwargs or {})  # fmt: skip


async def trajectory(loop: ToolAgentLoop, actions: list[dict[str, Any]], rid: str) -> Any:
    data = agent_data(rid, ROW)
    texts, rewards, times = [], [], []
    for action in actions:
        call = FunctionCall(name="sandbox", arguments=json.dumps(action))
        t0 = time.perf_counter()
        response, reward, _ = await loop._call_tool(call, data.tools_kwargs, data)
        times.append(time.perf_counter() - t0)
        texts.append(response.text)
        rewards.append(reward)
    return texts, rewards, times


async def main() -> list[float]:
    # The shipped example config, loaded as a verl run loads it.
    tools = initialize_tools_from_config(str(EXAMPLES / "corral_tools.yaml"))
    assert [t.name for t in tools] == ["sandbox", "run_code"], [t.name for t in tools]
    loop = loop_over(tools)
    (right, wrong) = await asyncio.gather(
        trajectory(loop, RIGHT, "traj-right"), trajectory(loop, WRONG, "traj-wrong")
    )
    texts, rewards, times = right
    assert "AssertionError" in texts[0], texts[0]  # the bug, seen
    assert "a - b" in texts[1], texts[1]  # read
    assert texts[2].startswith("edited"), texts[2]
    assert "passed" in texts[3], texts[3]  # the edit persisted across calls
    assert rewards == [0.0, 0.0, 0.0, 0.0, 1.0], rewards
    assert wrong[1][-1] == 0.0 and "reward 0" in wrong[0][-1], wrong
    sandbox = loop.tools["sandbox"]
    assert sandbox.open_trajectories == 0  # both submitted: closed

    # The model's mistakes are observations, not crashes.
    data = agent_data("traj-bad")
    bad = [
        FunctionCall(name="sandbox", arguments="{not json"),  # verl's own check
        FunctionCall(name="sandbox", arguments=json.dumps("rm -rf /")),
        FunctionCall(name="sandbox", arguments=json.dumps({"cmd": "ls"})),
        FunctionCall(name="sandbox", arguments=json.dumps({"command": 7})),
        FunctionCall(name="sandbox", arguments=json.dumps({"path": "nope.txt"})),
        FunctionCall(name="nosuchtool", arguments="{}"),
    ]
    answers = [(await loop._call_tool(c, {}, data))[0].text for c in bad]
    assert "Invalid JSON" in answers[0], answers[0]
    assert "must be a JSON object" in answers[1], answers[1]
    assert "unrecognised fields" in answers[2], answers[2]
    assert "must be a string" in answers[3], answers[3]
    assert answers[4].startswith("error:"), answers[4]
    assert "Unknown function" in answers[5], answers[5]
    assert sandbox.open_trajectories == 1
    assert await sandbox.end("traj-bad") == 0.0
    done = await loop._call_tool(
        FunctionCall(name="sandbox", arguments='{"command": "ls"}'), {}, data
    )
    assert "was closed" in done[0].text, done[0].text  # stepped after close

    # The agent loop's end of trajectory: registered under its name,
    # it closes the trajectory's sandbox and grades it, even unsubmitted.
    import hydra
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

    from corral.integrations import verl_loop

    target = _agent_loop_registry[verl_loop.NAME]["_target_"]
    assert hydra.utils.get_class(target) is verl_loop.CorralToolAgentLoop, target
    agent = loop_over(tools, verl_loop.CorralToolAgentLoop)
    for _ in range(2):  # deterministic ids repeat across training steps
        rid = agent._make_request_id(0, True)
        assert rid == "det-0", rid
        for action in RIGHT[:3]:
            call = FunctionCall(name="sandbox", arguments=json.dumps(action))
            await agent._call_tool(call, ROW, agent_data(rid, ROW))
        assert sandbox.open_trajectories == 1
        assert await agent.corral_end() == 1.0  # fixed, not submitted: graded at the end
        assert sandbox.open_trajectories == 0

    # A trajectory that goes silent loses its sandbox after idle_release.
    from corral.integrations.verl import CorralSandboxTool

    idle = CorralSandboxTool({"type": "native", "idle_release": 1, **TASK})
    quiet = loop_over([idle])
    call = FunctionCall(name="sandbox", arguments='{"command": "true"}')
    await quiet._call_tool(call, {}, agent_data("traj-quiet"))
    assert idle.open_trajectories == 1
    for _ in range(1000):
        await asyncio.sleep(0.01)
        if idle.open_trajectories == 0:
            break
    assert idle.open_trajectories == 0, "the idle trajectory was not released"
    # At once: the release is still closing its sandbox. aclose had cancelled
    # it and closed the client under it (the sandbox stayed open).
    await idle.aclose()

    # Stateless code execution through the same registry.
    code = FunctionCall(name="run_code", arguments=json.dumps({"code": "print(6*7)"}))
    out = (await loop._call_tool(code, {}, data))[0].text
    assert "status: ok" in out and "42" in out, out

    # A row naming an image the node lacks, or a field that does not
    # exist: the model reads why, the trainer goes on.
    for create_kwargs, want in (
        ({"image": "no-such:image"}, "no-such"),
        ({"tset": "pytest"}, "create_kwargs.tset"),
    ):
        row = {"sandbox": {"create_kwargs": create_kwargs}}
        call = FunctionCall(name="sandbox", arguments='{"command": "ls"}')
        text = (await loop._call_tool(call, row, agent_data(f"m-{want}", row)))[0].text
        assert "could not start" in text and want in text, text
    for tool in tools:
        if hasattr(tool, "aclose"):
            await tool.aclose()
    return times


step_s = asyncio.run(main())
check_left_open()
report(step_s=step_s, label=LABEL)
