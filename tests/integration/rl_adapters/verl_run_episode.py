"""verl's own multi-turn rollout, end to end, on Corral: the agent loop
registered as `corral_tool_agent`, made the way verl's AgentLoopWorker
makes it (hydra.utils.instantiate over verl's generated trainer config),
runs ToolAgentLoop.run: the prompt through a chat template, the model's
turns parsed for <tool_call> by verl's hermes parser, each call through
the tool, the tool's answer appended, until the model stops. The model is
a scripted server (fixed completions, no weights) and the tokenizer a
byte-level one made here; everything else is verl's. The output's
reward_score is the sandbox's test, and the trajectory's sandbox is closed
when run() returns."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import hydra
import verl
from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
from verl.tools.tool_registry import initialize_tools_from_config
from verl.workers.rollout.replica import TokenOutput

sys.path.insert(0, str(Path(__file__).parent))
from task import RIGHT, TASK, WRONG, check_left_open, report

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "verl"
ROW = {"sandbox": {"create_kwargs": {k: v for k, v in TASK.items() if k != "image"}}}
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level, no merges: any text round-trips."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>", pad_token="<|pad|>")
    fast.chat_template = TEMPLATE
    return fast


class ScriptedServer:
    """The model: for each trajectory, its next completion."""

    def __init__(self, tok: PreTrainedTokenizerFast, scripts: dict[str, list[str]]) -> None:
        self.tok = tok
        self.scripts = scripts
        self.by_request: dict[str, list[str]] = {}
        self.prompts: list[str] = []

    async def generate(self, *, request_id: str, prompt_ids: list[int], **_: Any) -> TokenOutput:
        prompt = self.tok.decode(prompt_ids)
        self.prompts.append(prompt)
        if request_id not in self.by_request:  # which agent: named in its prompt
            agent = next(name for name in self.scripts if name in prompt)
            self.by_request[request_id] = list(self.scripts[agent])
        text = self.by_request[request_id].pop(0)
        return TokenOutput(token_ids=self.tok.encode(text, add_special_tokens=False))


def completions(actions: list[dict[str, Any]]) -> list[str]:
    calls = [f'<tool_call>{json.dumps({"name": "sandbox", "arguments": a})}</tool_call>'
             for a in actions]  # fmt: skip
    return [f"Step {i + 1}.\n{c}" for i, c in enumerate(calls)] + ["Done."]


async def main() -> dict[str, Any]:
    config = OmegaConf.load(
        Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml"
    )
    rollout = config.actor_rollout_ref.rollout
    rollout.prompt_length, rollout.response_length = 4096, 16384
    rollout.multi_turn.enable = True
    rollout.multi_turn.max_tool_response_length = 4096
    rollout.multi_turn.tool_config_path = str(EXAMPLES / "corral_tools.yaml")
    loops = OmegaConf.load(EXAMPLES / "corral_agent_loop.yaml")
    tools = initialize_tools_from_config(rollout.multi_turn.tool_config_path)
    tok = tokenizer()
    server = ScriptedServer(tok, {"honest": completions(RIGHT), "careless": completions(WRONG)})

    def make() -> Any:  # as AgentLoopWorker.run_agent_loop does
        return hydra.utils.instantiate(
            config=loops[0], trainer_config=DictConfigWrap(config=config),
            server_manager=server, tokenizer=tok, processor=None, hf_model_type=None,
            dataset_cls=None, data_config=DictConfigWrap(config.data), tools=ToolListWrap(tools),
        )  # fmt: skip

    async def trajectory(agent: str) -> Any:
        prompt = [{"role": "user", "content": f"You are the {agent} agent. Fix add() in calc.py."}]
        return await make().run({"temperature": 1.0}, raw_prompt=prompt, tools_kwargs=ROW,
                                extra_info={})  # fmt: skip

    honest, careless = await asyncio.gather(trajectory("honest"), trajectory("careless"))
    assert honest.reward_score == 1.0, (honest.reward_score, honest.extra_fields)
    assert careless.reward_score == 0.0, (careless.reward_score, careless.extra_fields)
    assert honest.extra_fields["corral_reward"] == 1.0
    # The tool's answers reached the model: the failing test, then the passing one.
    seen = max((p for p in server.prompts if "honest" in p), key=len)
    assert "AssertionError" in seen and "passed" in seen and "reward 1" in seen, seen[-2000:]
    assert honest.num_turns >= 11, honest.num_turns  # user + 5 x (assistant, tool) + final
    sandbox = next(t for t in tools if t.name == "sandbox")
    assert sandbox.open_trajectories == 0
    for tool in tools:
        await tool.aclose()
    return {"turns": honest.num_turns, "response_tokens": len(honest.response_ids)}


stats = asyncio.run(main())
check_left_open()
report(**stats)
