"""The environment interface (docs/design/envs.md "Interface") and the
answer-extraction rule.

An `Environment` runs one episode at a time:

  obs = env.reset(task)                      # the prompt, as text (or token ids)
  obs, reward, done, info = env.step(action)  # action = the policy's text

Observations are appended verbatim to the context (action mask 0); the prompt
observation already carries the chat template (`self.template`, set by the
episode runner to the policy tokenizer's).
`set_policy_version` tells the environment which policy version produced the
next action (the evolving environment's reward depends on it).
"""

from __future__ import annotations

import abc
from typing import Any, NamedTuple, Sequence

from sao_jax.tokenization.chat_template import ChatTemplate
from sao_jax.tokenization.chat_template import SAO_MARKUP

Observation = str | Sequence[int]


class StepResult(NamedTuple):
  """What `Environment.step` returns; unpacks as (obs, reward, done, info)."""

  observation: Observation
  reward: float
  done: bool
  info: dict[str, Any]


class Environment(abc.ABC):
  """One episode at a time; instances are not shared between batch rows.

  Attributes:
    name: Task/environment name recorded in trajectories.
    prompt_id: Stable id of the current task (set by `reset`).
  """

  name: str = "env"
  prompt_id: int = -1
  template: ChatTemplate = SAO_MARKUP  # The policy tokenizer's template.
  # True: an action is complete when it reaches `action_budget()` tokens and
  # goes to `step` without a stop token (a benchmark's fixed-length request,
  # as vLLM's ``ignore_eos``); otherwise reaching it ends the episode.
  fixed_length_actions: bool = False

  @abc.abstractmethod
  def reset(self, task: Any) -> Observation:
    """Starts an episode on `task`; returns the prompt observation."""

  @abc.abstractmethod
  def step(self, action_text: str) -> StepResult:
    """Consumes one action segment; returns (observation, reward, done, info)."""

  @classmethod
  def from_config(cls, env_cfg: Any, tasks: Any, *,
                  reward: str | None = None) -> "Environment":
    """An instance over `tasks`, set up from `env_cfg` (the `config.env`
    section) by `config_kwargs`; `reward` overrides `env.reward`."""
    return cls(tasks, **cls.config_kwargs(env_cfg, reward))

  @classmethod
  def config_kwargs(cls, env_cfg: Any, reward: str | None) -> dict[str, Any]:
    """The constructor's keywords from `config.env`: an environment with
    settings of its own adds them to its base class's (`super()`)."""
    del reward  # Read by the environments that score with a rule.
    return {"instruction": env_cfg.get("instruction", "")}

  def set_template(self, template: ChatTemplate) -> None:
    """Writes prompts and observations in the policy tokenizer's template."""
    self.template = template

  def set_policy_version(self, version: int) -> None:
    """Version of the policy that produced the next action (default: unused)."""
    del version

  def action_budget(self) -> int | None:
    """Most tokens the next action may take (None: the sampler's limit).

    An action that reaches it ends the episode (``LENGTH``), like one that
    reaches ``sampler.max_new_tokens`` (unless ``fixed_length_actions``).
    """
    return None


def final_answer(action_text: str,
                 template: ChatTemplate = SAO_MARKUP) -> str:
  """The answer in an assistant's final action -- the only extraction rule.

  The answer is the text after the last tool result (if the text holds one),
  with the template's end-of-turn marker and anything after it removed, and
  surrounding whitespace stripped. Answer wrappers (`\\boxed{}`,
  `<answer></answer>`) are the evolving environment's business (evolving.py),
  not part of this rule.
  """
  return template.reply_text(action_text)
