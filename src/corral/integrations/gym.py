"""A gymnasium environment (`pip install corral[gym]`) for any training
loop: text observations, text actions (integrations/actions.py's tags),
one stateful Corral sandbox per episode, the reward the task's test.

    env = gymnasium.make("corral/Sandbox-v0", task={"image": ..., "test": ...})
    obs, info = env.reset()
    while True:
        obs, reward, terminated, truncated, info = env.step(policy(obs))
        if terminated or truncated:
            break
    env.close()

reset() closes the previous episode's sandbox and starts a new one;
`reset(options={"task": {...}})` overrides the task's fields for that
episode (a dataset row). `terminated` means the agent submitted (or the
sandbox went away); `truncated`, that the step limit was reached. Both
come with the graded reward.
"""

from __future__ import annotations

from typing import Any

import gymnasium

from corral.errors import CorralError
from corral.integrations.actions import from_text
from corral.integrations.connect import blocking, shared_client
from corral.integrations.episode import AsyncEpisode, EpisodeSpec
from corral.sdk.client import AsyncClient

ENV_ID = "corral/Sandbox-v0"


class AnyText(gymnasium.spaces.Space[str]):
    """Any string up to `max_length` characters: gymnasium's Text space
    insists on a charset, and a shell's output is any Unicode."""

    def __init__(self, max_length: int) -> None:
        super().__init__(shape=None, dtype=None)
        self.max_length = max_length

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        return "<bash>" + "echo " + str(self.np_random.integers(0, 10**6)) + "</bash>"

    @property
    def is_np_flattenable(self) -> bool:
        return False


def register() -> None:
    if ENV_ID not in gymnasium.registry:
        gymnasium.register(
            id=ENV_ID, entry_point="corral.integrations.gym:CorralEnv", nondeterministic=True
        )


class CorralEnv(gymnasium.Env[str, str]):
    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(
        self,
        task: dict[str, Any],
        *,
        url: str | None = None,
        api_key: str | None = None,
        prompt: str = "",
        client: AsyncClient | None = None,
    ) -> None:
        """`client`: a client of the caller's own (e.g. an embedded node
        with its config), used on the adapters' loop; else one shared by
        every environment of this process for `url` and `api_key`."""
        self.task = dict(task)
        self.prompt = prompt
        self.spec_ = EpisodeSpec.from_config(self.task, prefix="task.")
        self.observation_space = AnyText(self.spec_.observation_limit + 200)
        self.action_space = AnyText(1_000_000)
        self._client = client or shared_client(url, api_key)
        self.episode: AsyncEpisode | None = None

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        self._end()
        spec = self.spec_
        if options and options.get("task"):
            spec = EpisodeSpec.from_config({**self.task, **options["task"]}, prefix="task.")
        self.episode = AsyncEpisode(self._client, spec, labels={"gym.env": "corral"})
        try:
            blocking(self.episode.start)
        except CorralError as exc:
            # Not the trainer's crash: the episode is over at its first step.
            self.episode.closed = True
            return f"error: the sandbox could not start: {exc}", {"error": str(exc)}
        return options.get("prompt", self.prompt) if options else self.prompt, {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        if self.episode is None:
            return "error: call reset() first", 0.0, True, False, {}
        step = blocking(self.episode.act, from_text(action))
        info: dict[str, Any] = {
            "ok": step.ok,
            "corral_step_s": step.seconds,
            "corral_command_s": step.command_s,
        }
        if step.verdict is not None:
            info["corral_verdict"] = step.verdict  # filter the reward on it
        if step.done:
            self._end()
        return (
            step.observation,
            step.reward or 0.0,
            step.done and not step.truncated,
            step.truncated,
            info,
        )

    def _end(self) -> None:
        if self.episode is not None and not self.episode.closed:
            blocking(self.episode.close)

    def close(self) -> None:
        self._end()
