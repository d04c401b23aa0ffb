"""A SkyRL environment (`pip install corral[skyrl]`): each episode a
stateful Corral sandbox, actions the model's text with tags (<bash>,
<write>, <edit>, <read>, <submit/>: integrations/actions.py), the reward
the task's test command run inside the sandbox when the agent submits or
runs out of turns.

    from corral.integrations import skyrl
    skyrl.register()                       # id "corral"
    env = skyrl_gym.make("corral", env_config={"image": ..., "test": ...},
                         extras={"max_turns": 5, "corral": {"workspace": ...}})

`env_config` is the task family (create()'s fields and the episode's);
`extras["corral"]`, one dataset row's own fields, overrides it, and
`extras["max_turns"]` (SkyRL's generator sets it) bounds the steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv

from corral.errors import CorralError
from corral.integrations.actions import from_text
from corral.integrations.connect import blocking, shared_client
from corral.integrations.episode import AsyncEpisode, EpisodeSpec

ENV_ID = "corral"


def register(env_id: str = ENV_ID) -> None:
    """Register the environment with skyrl_gym (again: a no-op)."""
    if env_id not in skyrl_gym.envs.registration.registry:
        skyrl_gym.envs.register(id=env_id, entry_point="corral.integrations.skyrl:CorralTextEnv")


def _plain(config: Any) -> dict[str, Any]:
    # env_config arrives as an OmegaConf DictConfig from SkyRL's trainer.
    if config is None:
        return {}
    if isinstance(config, Mapping):
        return {str(k): _plain(v) if isinstance(v, Mapping) else v for k, v in config.items()}
    from omegaconf import OmegaConf

    return dict(OmegaConf.to_container(config, resolve=True))


class CorralTextEnv(BaseTextEnv):  # type: ignore[misc]
    def __init__(self, env_config: Any = None, extras: dict[str, Any] | None = None) -> None:
        super().__init__()
        extras = extras or {}
        fields = {**_plain(env_config), **_plain(extras.get("corral"))}
        url, api_key = fields.pop("url", None), fields.pop("api_key", None)
        if "max_turns" in extras:
            fields.setdefault("max_steps", int(extras["max_turns"]))
        self.spec_ = EpisodeSpec.from_config(fields, prefix="env_config.")
        self.max_turns = self.spec_.max_steps
        self.episode = AsyncEpisode(
            shared_client(url, api_key), self.spec_, labels={"skyrl.env": ENV_ID}
        )
        self.start_error: str | None = None
        self.reward = 0.0

    def init(self, prompt: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        try:
            blocking(self.episode.start)
        except CorralError as exc:
            # The trainer goes on: the first step ends the episode with this.
            self.start_error = f"error: the sandbox could not start: {exc}"
        return prompt, {}

    def step(self, action: str) -> dict[str, Any]:
        self.turns += 1
        if self.start_error is not None:
            return {
                "observations": [],
                "reward": 0.0,
                "done": True,
                "metadata": {"error": self.start_error},
            }
        step = blocking(self.episode.act, from_text(action))
        if step.done:
            self.reward = step.reward or 0.0
            blocking(self.episode.close)
        observations = [] if step.done else [{"role": "user", "content": step.observation}]
        return {
            "observations": observations,
            "reward": step.reward or 0.0,
            "done": step.done,
            "metadata": {
                "observation": step.observation,
                "ok": step.ok,
                "corral_step_s": step.seconds,
            },
        }

    def get_metrics(self) -> dict[str, Any]:
        stats = self.episode.stats
        return {"steps": stats.steps, "errors": stats.errors, "reward": self.reward}

    def close(self) -> None:
        blocking(self.episode.close)
