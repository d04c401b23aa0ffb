"""The OpenAI Agents SDK 0.24 drives Corral through Corral's own sandbox
provider: a SandboxAgent run by the SDK's Runner, its model a
ScriptedModel from the SDK's testing package (no network), five tool
calls with state kept between them (the SDK's exec_command and
apply_patch tools), the task's test as the reward. Then pause and resume:
the session's sandbox is suspended with a process running in it, its
state serialised, and client.resume(state) reattaches to that same
sandbox, the process still there."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from agents import RunConfig, Runner
from agents.sandbox import Manifest, SandboxAgent, SandboxRunConfig
from agents.sandbox.entries import File
from agents.sandbox.errors import ExecTransportError
from agents.sandbox.snapshot import NoopSnapshotSpec
from agents.testing import ScriptedModel, assistant_message, function_call
from openai.types.responses import ResponseCustomToolCall

import corral
from corral.integrations.openai_agents import CorralSandboxClient, CorralSandboxOptions

sys.path.insert(0, str(Path(__file__).parent))
from task import IMAGE, LABEL, TASK, check_left_open, report

URL = os.environ["CORRAL_URL"]
CALC = b"def add(a, b):\n    return a - b\n"
TEST = b"from calc import add\nassert add(2, 3) == 5, add(2, 3)\nprint('passed')\n"
PATCH = "*** Begin Patch\n*** Update File: calc.py\n@@\n-    return a - b\n+    return a + b\n*** End Patch\n"
OPTIONS = CorralSandboxOptions(image=IMAGE, labels={"test": LABEL}, env=TASK["env"])


def agent(model: ScriptedModel) -> SandboxAgent:
    manifest = Manifest(entries={"calc.py": File(content=CALC), "test_calc.py": File(content=TEST)})
    return SandboxAgent(name="fixer", model=model, instructions="Fix calc.py.",
                        default_manifest=manifest)  # fmt: skip


def outputs(model: ScriptedModel) -> list[str]:
    return [str(dict(call.input[-1]).get("output", "")) for call in model.calls[1:]]


async def scripted_episode() -> list[float]:
    model = ScriptedModel([
        [function_call("exec_command", "{not json", call_id="c0")],  # the model's mistake
        [function_call("exec_command", {"cmd": "python3 test_calc.py"}, call_id="c1")],
        [function_call("exec_command", {"cmd": "cat calc.py"}, call_id="c2")],
        [ResponseCustomToolCall(type="custom_tool_call", id="c3", call_id="c3",
                                name="apply_patch", input=PATCH)],
        [function_call("exec_command", {"cmd": "python3 test_calc.py > result.txt"},
                       call_id="c4")],
        [function_call("exec_command", {"cmd": "cat result.txt"}, call_id="c5")],
        [assistant_message("fixed")],
    ])  # fmt: skip
    client = CorralSandboxClient(URL)
    t0 = time.perf_counter()
    result = await Runner.run(agent(model), "Fix calc.py so the test passes.",
                              run_config=RunConfig(tracing_disabled=True, sandbox=SandboxRunConfig(
                                  client=client, options=OPTIONS, snapshot=NoopSnapshotSpec())))  # fmt: skip
    wall = time.perf_counter() - t0
    model.assert_complete()
    out = outputs(model)
    assert result.final_output == "fixed", result.final_output
    assert "Invalid tool arguments" in out[0], out[0]  # told, not crashed
    assert "AssertionError" in out[1], out[1]
    assert "a - b" in out[2], out[2]
    assert "calc.py" in out[3], out[3]
    assert "passed" in out[5], out[5]  # state kept: the patch, then result.txt
    await client.corral.aclose()
    return [wall]


async def pause_and_resume() -> None:
    client = CorralSandboxClient(URL)
    options = CorralSandboxOptions(image=IMAGE, labels={"test": LABEL}, on_shutdown="suspend")
    session = await client.create(manifest=Manifest(entries={"note.txt": File(content=b"kept")}),
                                  options=options, snapshot=NoopSnapshotSpec())  # fmt: skip
    await session.start()
    r = await session.exec("sleep 300 & echo $! > pid; cat note.txt")
    assert r.ok() and r.stdout == b"kept", r.stdout
    state = client.serialize_session_state(session.state)
    await session.shutdown()  # on_shutdown="suspend"
    async with corral.AsyncClient(URL) as c:
        sbx = await c.sandboxes.get(state["sandbox_id"])
        assert sbx.info.state == "suspended", sbx.info.state
    # Another client (another process, after a preemption) picks it up.
    other = CorralSandboxClient(URL)
    resumed = await other.resume(other.deserialize_session_state(state))
    await resumed.start()
    assert resumed.state.sandbox_id == state["sandbox_id"]
    r = await resumed.exec("kill -0 $(cat pid) && echo alive; cat note.txt")
    assert r.stdout == b"alive\nkept", r.stdout
    await other.delete(resumed)
    try:  # a closed session's exec: a clear error of the SDK's own kind
        await resumed.exec("ls")
    except ExecTransportError as exc:
        assert "closed" in str(exc.cause) or "not found" in str(exc.cause).lower(), exc.cause
    else:
        raise AssertionError("exec on a deleted session succeeded")
    # Resuming a sandbox that is gone makes a new one (the SDK refills it).
    gone = await other.resume(other.deserialize_session_state(state))
    assert gone.state.sandbox_id != state["sandbox_id"]
    await other.delete(gone)
    await client.corral.aclose()
    await other.corral.aclose()


times = asyncio.run(scripted_episode())
asyncio.run(pause_and_resume())
check_left_open()
report(wall_s=times)
