"""verl's ToolAgentLoop with Corral's end of trajectory (`corral[verl]`).

verl 0.9 gives a tool no hook at the end of a trajectory, so a stateful
sandbox would live until its idle release. This loop, registered as
`corral_tool_agent`, wraps ToolAgentLoop.run: when the trajectory ends,
however it ends (the model stopped, the length limit, an exception), the
trajectory's Corral sandboxes are closed, and, unless the agent loop set
one already, the output's `reward_score` is the sandbox's test, graded
then (verl then uses it and skips its reward function). Register it with

    actor_rollout_ref.rollout.agent.agent_loop_config_path=<a file with>
      - name: corral_tool_agent
        _target_: corral.integrations.verl_loop.CorralToolAgentLoop
    actor_rollout_ref.rollout.agent.default_agent_loop=corral_tool_agent

or import this module in the worker (it registers itself).
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.agent_loop import register
from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop

from corral.integrations.verl import CorralSandboxTool

NAME = "corral_tool_agent"


@register(NAME)
class CorralToolAgentLoop(ToolAgentLoop):  # type: ignore[misc]
    def _make_request_id(self, *args: Any, **kwargs: Any) -> str:
        request_id: str = super()._make_request_id(*args, **kwargs)
        self.__dict__.setdefault("_corral_requests", []).append(request_id)
        return request_id

    async def corral_end(self) -> float | None:
        """Close this trajectory's sandboxes; the first Corral tool's reward."""
        reward: float | None = None
        for request_id in self.__dict__.pop("_corral_requests", []):
            for tool in self.tools.values():
                if isinstance(tool, CorralSandboxTool):
                    got = await tool.end(request_id, forget=True)
                    reward = got if reward is None else reward
        return reward

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs: Any) -> Any:
        try:
            output = await super().run(sampling_params, priority=priority, **kwargs)
        except BaseException:
            await self.corral_end()
            raise
        reward = await self.corral_end()
        if reward is not None:
            output.extra_fields["corral_reward"] = reward
            if output.reward_score is None:
                output.reward_score = reward
        return output
