"""Corral in the training frameworks' own interfaces, written once.

Each adapter is an optional extra, importing its framework at import time:

- `corral.integrations.verl`: verl tools (`corral[verl]`), a stateful
  sandbox per trajectory and stateless function calls;
- `corral.integrations.skyrl`: a skyrl_gym text environment (`corral[skyrl]`);
- `corral.integrations.openai_agents`: a native sandbox provider for the
  OpenAI Agents SDK (`corral[openai-agents]`);
- `corral.integrations.gym`: a gymnasium environment (`corral[gym]`).

They share `episode` (one stateful sandbox, actions, the test as reward)
and `actions` (what a model's text or tool call asks for). See
docs/integrations.md.
"""
