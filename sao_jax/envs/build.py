"""Tasks and environments built from the ``config.env`` section.

The sampler process (training episodes) and the trainer (held-out evaluation)
build their environments here, so both see the same tasks and template.
"""

from __future__ import annotations

from typing import Any

from sao_jax.envs import code_env
from sao_jax.envs import function_tasks
from sao_jax.envs import registry
from sao_jax.envs import repair_env
from sao_jax.envs.base import Environment
from sao_jax.envs.reasoning_gym_env import ReasoningGymTasks
from sao_jax.envs.reasoning_gym_env import train_eval_split
from sao_jax.grading import humaneval


def build_tasks(env_cfg: Any) -> tuple[ReasoningGymTasks, ReasoningGymTasks]:
  """(training tasks, held-out tasks) with disjoint item seeds, or the
  codeio function tasks' two splits (`env.dataset = 'codeio'`); with
  `env.eval_dataset = 'humaneval'` the held-out tasks are HumanEval's first
  `env.eval_size` problems (all 164 at most)."""
  if env_cfg.get("eval_dataset", "") == humaneval.NAME:  # HumanEval itself.
    train, _ = build_tasks(_without_eval_dataset(env_cfg))
    return train, humaneval.HumanEvalTasks(
        function_tasks.shared_grader(env_cfg).pool, env_cfg.eval_size)
  if env_cfg.dataset == function_tasks.NAME:
    return function_tasks.train_eval_tasks(env_cfg)
  if env_cfg.name == repair_env.NAME:  # The environment's own tasks.
    return repair_env.train_eval_tasks(
        env_cfg, function_tasks.shared_grader(env_cfg).pool)
  return train_eval_split(
      env_cfg.dataset, dict(env_cfg.dataset_config),
      train_seed=env_cfg.seed, train_size=env_cfg.size,
      eval_seed=env_cfg.eval_seed, eval_size=env_cfg.eval_size)


def _without_eval_dataset(env_cfg: Any) -> Any:
  env_cfg = env_cfg.copy_and_resolve_references()
  env_cfg.eval_dataset = ""
  return env_cfg


def make_envs(env_cfg: Any, tasks: ReasoningGymTasks, n: int,
              *, name: str | None = None,
              reward: str | None = None) -> list[Environment]:
  """``n`` independent environments of the configured kind over ``tasks``.

  Args:
    env_cfg: The ``config.env`` section.
    tasks: Task set the environments draw from.
    n: Number of instances (one per batch row).
    name: Override of ``env_cfg.name`` (evaluation of the evolving env uses
      the plain reasoning-gym scorer for quality).
    reward: Override of ``env_cfg.reward`` (held-out accuracy is 'exact').

  Each instance is the registered class's ``from_config(env_cfg, tasks)``:
  the class reads its own settings (``Environment.config_kwargs``).
  """
  env = registry.get_env(env_cfg.name if name is None else name)
  return [env.from_config(env_cfg, tasks, reward=reward) for _ in range(n)]


def publish_metrics(stats: Any) -> None:
  """Puts this process's environment counters (the code tool's, each with
  its merge rule) into `stats` (the sampler's shared counters, written to
  TensorBoard; ``sampler/stats.py``)."""
  code_env.publish(stats)
