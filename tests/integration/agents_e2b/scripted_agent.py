"""A scripted agent of the OpenAI Agents SDK (openai-agents[e2b], unmodified)
on Corral through E2B: run by tests/integration/test_openai_agents.py with
the agents' own virtual environment (it pins e2b 2.31), configured by the
E2B_* environment variables alone.

No LLM: ScriptedModel replays three turns. apply_patch writes
notes/hello.txt in the workspace, exec_command reads it back and runs
python3, and a final message ends the run. The SDK's E2B client creates the
sandbox and kills it. Exit 0 when every check holds.
"""

import asyncio
import json
import sys
import uuid

from agents import ModelResponse, RunConfig, Runner, Usage, set_tracing_disabled
from agents.extensions.sandbox.e2b import E2BSandboxClient, E2BSandboxClientOptions
from agents.items import ToolCallOutputItem
from agents.models.interface import Model
from agents.sandbox import Manifest, SandboxAgent, SandboxRunConfig
from e2b import AsyncSandbox, SandboxQuery
from openai.types.responses import (
    ResponseCustomToolCall,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
)

set_tracing_disabled(True)  # tracing would otherwise want an OpenAI key

RUN_TAG = uuid.uuid4().hex  # metadata label so we can find *our* sandbox on the server
FILE_TEXT = "hello from the scripted agent"

# The SDK's own defaults throughout: its workspace root (/workspace, which envd
# makes for the user), its timeouts (24 h for a command without one).
WORKSPACE_ROOT = "/workspace"
FINAL_TEXT = "Done: wrote notes/hello.txt, read it back, and python3 printed 42."

# --- The script: one list of output items per model turn ---------------------------------
SCRIPT = [
    # Turn 1: write a file through the Filesystem capability's apply_patch (custom tool).
    [
        ResponseCustomToolCall(
            type="custom_tool_call",
            id="ctc_1",
            call_id="call_write",
            name="apply_patch",
            input=f"*** Begin Patch\n*** Add File: notes/hello.txt\n+{FILE_TEXT}\n*** End Patch\n",
        )
    ],
    # Turn 2: read it back and run python3 through the Shell capability's exec_command.
    [
        ResponseFunctionToolCall(
            type="function_call",
            id="fc_2",
            call_id="call_exec",
            name="exec_command",
            arguments=json.dumps(
                {
                    # `echo`: the SDK's apply_patch writes "Add File" content without a final newline.
                    "cmd": "cat notes/hello.txt && echo && python3 -c 'print(6 * 7)' && pwd && whoami",
                }
            ),
        )
    ],
    # Turn 3: final answer.
    [
        ResponseOutputMessage(
            type="message",
            id="msg_3",
            role="assistant",
            status="completed",
            content=[ResponseOutputText(type="output_text", text=FINAL_TEXT, annotations=[])],
        )
    ],
]


class ScriptedModel(Model):
    """A fake Model: ignores the prompt and returns the next scripted turn."""

    def __init__(self) -> None:
        self.turn = 0
        self.tool_names: list[str] = []
        self.live_sandboxes_seen: list[str] = []  # server-side view during the run

    async def get_response(
        self,
        system_instructions,
        input,
        model_settings,
        tools,
        output_schema,
        handoffs,
        tracing,
        *,
        previous_response_id,
        conversation_id,
        prompt,
    ) -> ModelResponse:
        if self.turn == 0:
            self.tool_names = [t.name for t in tools]
            # While the run is live, ask the server (control API) for our sandbox.
            infos = await AsyncSandbox.list(
                query=SandboxQuery(metadata={"run_tag": RUN_TAG})
            ).next_items()
            self.live_sandboxes_seen = [i.sandbox_id for i in infos]
        if self.turn >= len(SCRIPT):
            raise RuntimeError("script exhausted: the runner asked for an extra turn")
        output = SCRIPT[self.turn]
        self.turn += 1
        return ModelResponse(output=list(output), usage=Usage(), response_id=f"resp_{self.turn}")

    async def stream_response(self, *args, **kwargs):  # streaming is not used here
        raise NotImplementedError("ScriptedModel only supports Runner.run (non-streaming)")
        yield  # pragma: no cover - makes this an async generator


async def main() -> int:
    model = ScriptedModel()
    agent = SandboxAgent(  # default capabilities: Filesystem, Shell, Compaction
        name="scripted-e2b-agent",
        instructions="Follow the script.",
        model=model,
    )
    run_config = RunConfig(
        sandbox=SandboxRunConfig(
            client=E2BSandboxClient(),  # the SDK's normal E2B path: create on start, kill on cleanup
            options=E2BSandboxClientOptions(
                sandbox_type="e2b",
                template="base",
                timeout=300,
                metadata={"run_tag": RUN_TAG},
            ),
            manifest=Manifest(root=WORKSPACE_ROOT),
        )
    )

    result = await Runner.run(agent, "Write the note, check it, and report.", run_config=run_config)

    # Collect tool outputs keyed by call id.
    outputs: dict[str, str] = {}
    for item in result.new_items:
        if isinstance(item, ToolCallOutputItem):
            raw = item.raw_item
            call_id = raw.get("call_id") if isinstance(raw, dict) else getattr(raw, "call_id", None)
            outputs[str(call_id)] = str(item.output)

    # After the run the SDK should have killed the sandbox: ask the server again.
    left = await AsyncSandbox.list(query=SandboxQuery(metadata={"run_tag": RUN_TAG})).next_items()

    checks = [
        (
            "model offered exec_command + apply_patch",
            {"exec_command", "apply_patch"} <= set(model.tool_names),
        ),
        (
            "server listed exactly one live sandbox during the run",
            len(model.live_sandboxes_seen) == 1,
        ),
        ("apply_patch output reports the file", "notes/hello.txt" in outputs.get("call_write", "")),
        ("exec_command exited 0", "Process exited with code 0" in outputs.get("call_exec", "")),
        ("exec_command read the file back", FILE_TEXT in outputs.get("call_exec", "")),
        ("python3 printed 42", "\n42\n" in outputs.get("call_exec", "")),
        ("cwd is the workspace root", f"\n{WORKSPACE_ROOT}\n" in outputs.get("call_exec", "")),
        ("commands run as user 'user'", "\nuser\n" in outputs.get("call_exec", "")),
        ("all 3 scripted turns consumed", model.turn == len(SCRIPT)),
        ("final output is the scripted text", result.final_output == FINAL_TEXT),
        ("sandbox gone from server after the run (killed)", left == []),
    ]

    print(f"tools offered : {model.tool_names}")
    print(f"sandbox id    : {model.live_sandboxes_seen}")
    for call_id, text in outputs.items():
        print(f"--- tool output [{call_id}] ---\n{text.strip()}")
    print(f"--- final output ---\n{result.final_output}\n--- checks ---")
    for name, ok in checks:
        print(f"[{'PASS' if ok else 'FAIL'}] {name}")
    failed = [n for n, ok in checks if not ok]
    print("RESULT:", "PASS" if not failed else f"FAIL ({len(failed)} check(s))")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
