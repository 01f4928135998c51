"""Reasoning-gym tasks as single-turn environments, scored by reasoning-gym.

`ReasoningGymTasks` wraps `reasoning_gym.create_dataset(name, seed=, size=,
**config)`. Item `i` is generated from the seed `seed + i` (reasoning-gym's
rule), so that is its `prompt_id`. `train_eval_split` builds a training and a
held-out evaluation set and raises if their item seeds overlap.

`ReasoningGymEnv` asks the question once and scores the reply with the
dataset's own `score_answer(answer, entry)`, the answer being
`answers.extract(envs.base.final_answer(action_text), answer_rule)`. The reward
is that score turned by a rule (`REWARD_RULES`): 'exact' (default) pays 1 for
full credit and 0 for anything else; 'score' pays the score itself.
reasoning-gym gives partial credit len(oracle)/len(answer) to a wrong answer
that *contains* the right one ('-7' or '17' for 7 earns 0.5), which rewards
wrong answers.
"""

from __future__ import annotations

from typing import Any, Mapping

from sao_jax import reasoning_gym_import
from sao_jax.envs import answers
from sao_jax.envs.base import Environment
from sao_jax.envs.base import final_answer
from sao_jax.envs.base import StepResult


REWARD_RULES = ("exact", "score")

def reward_from_score(score: float, rule: str = "exact") -> float:
  """The episode reward of a reasoning-gym score under ``rule``."""
  if rule == "exact":
    return float(score >= 1.0)
  if rule == "score":
    return float(score)
  raise ValueError(f"Unknown reward rule {rule!r}; choose from {REWARD_RULES} "
                   "(env.reward).")


class ReasoningGymTasks:
  """A seeded reasoning-gym dataset: entries, prompt ids and its scorer."""

  def __init__(self, name: str, config: Mapping[str, Any] | None = None, *,
               seed: int, size: int):
    reasoning_gym = reasoning_gym_import.import_reasoning_gym((name,))
    self.name = name
    self.seed = int(seed)
    self.size = int(size)
    try:
      self.dataset = reasoning_gym.create_dataset(
          name, seed=self.seed, size=self.size, **dict(config or {}))
    except (ValueError, TypeError) as e:
      raise ValueError(
          f"Cannot create reasoning-gym dataset {name!r} with config "
          f"{dict(config or {})}: {e}. Check the name against "
          "reasoning_gym.factory.DATASETS and the config fields of its "
          "Config class.") from e
    self._cache: dict[int, dict[str, Any]] = {}

  def __len__(self) -> int:
    return self.size

  def item_seeds(self) -> range:
    """The per-item generator seeds (reasoning-gym uses seed + index)."""
    return range(self.seed, self.seed + self.size)

  def entry(self, index: int) -> dict[str, Any]:
    if not 0 <= index < self.size:
      raise IndexError(f"task index {index} not in [0, {self.size}).")
    if index not in self._cache:
      self._cache[index] = self.dataset[index]
    return self._cache[index]

  def prompt_id(self, index: int) -> int:
    return self.seed + int(index)

  def score(self, answer: str, index: int) -> float:
    """reasoning-gym's own `score_answer(answer, entry)`."""
    return float(self.dataset.score_answer(answer, self.entry(index)))


def check_disjoint(
    train: ReasoningGymTasks, evaluation: ReasoningGymTasks, *,
    labels: tuple[str, str] = ("training", "Evaluation"),
    fix: str = ("choose an eval_seed >= train_seed + train_size (or below "
                "train_seed - eval_size)")) -> None:
  """Raises ValueError if ``evaluation``'s items could repeat ``train``'s.

  ``labels`` name the two sets in the message; ``fix`` says what to change.
  """
  a, b = train.item_seeds(), evaluation.item_seeds()
  lo, hi = max(a.start, b.start), min(a.stop, b.stop)
  if train.name == evaluation.name and lo < hi:
    raise ValueError(
        f"{labels[1]} seeds [{b.start}, {b.stop}) overlap {labels[0]} seeds "
        f"[{a.start}, {a.stop}) of {train.name!r} on [{lo}, {hi}); {fix}.")


def train_eval_split(name: str, config: Mapping[str, Any] | None, *,
                     train_seed: int, train_size: int, eval_seed: int,
                     eval_size: int) -> tuple[ReasoningGymTasks,
                                              ReasoningGymTasks]:
  """Training and held-out evaluation tasks with disjoint item seeds."""
  train = ReasoningGymTasks(name, config, seed=train_seed, size=train_size)
  evaluation = ReasoningGymTasks(name, config, seed=eval_seed, size=eval_size)
  check_disjoint(train, evaluation)
  return train, evaluation


class ReasoningGymEnv(Environment):
  """Single turn: question -> one answer -> reasoning-gym score, done."""

  def __init__(self, tasks: ReasoningGymTasks, instruction: str = "",
               answer: str = "whole", reward: str = "exact"):
    """Args:
      tasks: the task set.
      instruction: text appended to every question (e.g. the answer format).
      answer: the answer-extraction rule (`answers.ANSWER_RULES`).
      reward: how a score becomes the reward (``REWARD_RULES``).
    """
    answers.extract("", answer)  # Fails early on an unknown rule.
    reward_from_score(1.0, reward)  # Raises on an unknown rule.
    self.answer_rule = answer
    self.reward = reward
    self.tasks = tasks
    self.name = tasks.name
    self.instruction = instruction
    self._index: int | None = None

  @classmethod
  def config_kwargs(cls, env_cfg: Any, reward: str | None) -> dict[str, Any]:
    return {**super().config_kwargs(env_cfg, reward),
            "answer": env_cfg.get("answer", "whole"),
            "reward": reward or env_cfg.get("reward", "exact")}

  def question(self, index: int) -> str:
    return self.tasks.entry(index)["question"] + self.instruction

  def reset(self, task: int) -> str:
    self._index = int(task)
    self.prompt_id = self.tasks.prompt_id(self._index)
    return self.template.format_prompt(self.question(self._index))

  def _require_episode(self) -> int:
    if self._index is None:
      raise RuntimeError(f"{type(self).__name__}.step called before reset.")
    return self._index

  def score(self, answer: str) -> float:
    return self.tasks.score(answer, self._require_episode())

  def step(self, action_text: str) -> StepResult:
    index = self._require_episode()
    answer = answers.extract(final_answer(action_text, self.template),
                             self.answer_rule)
    reward = reward_from_score(self.score(answer), self.reward)
    self._index = None
    return StepResult("", reward, True, {"answer": answer, "task_index": index})
