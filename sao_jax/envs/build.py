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
  """
  name = env_cfg.name if name is None else name
  kwargs: dict[str, Any] = {"instruction": env_cfg.get("instruction", "")}
  if name in ("reasoning_gym", "tool", "tool_longtail", "code"):  # Evolving: binary quality already.
    kwargs["answer"] = env_cfg.get("answer", "whole")
    kwargs["reward"] = reward or env_cfg.get("reward", "exact")
  if name in ("tool", "tool_longtail", "code"):
    kwargs["max_tool_calls"] = env_cfg.max_tool_calls
  if name == "code":  # Hidden tests: the tool sees no task data either.
    kwargs["pool"] = code_env.shared_pool(
        env_cfg, packages=env_cfg.dataset != function_tasks.NAME)
    kwargs["observation_chars"] = int(env_cfg.code_observation_chars)
  if name == repair_env.NAME:
    kwargs["max_tool_calls"] = env_cfg.max_tool_calls
    kwargs["observation_chars"] = int(env_cfg.code_observation_chars)
  if name == "tool_longtail":
    kwargs["min_tokens"] = int(env_cfg.longtail_min_tokens)
    kwargs["levels"] = int(env_cfg.longtail_levels)
    kwargs["tool_calls"] = int(env_cfg.longtail_tool_calls)
    kwargs["tool_latency_s"] = float(env_cfg.longtail_tool_latency_s)
  elif name == "evolving":
    kwargs["styles"] = tuple(env_cfg.styles)
    kwargs["switch_at"] = tuple(env_cfg.style_change_steps)
  return [registry.make_env(name, tasks, **kwargs) for _ in range(n)]


def publish_metrics(stats: Any) -> None:
  """Copies this process's environment counters (the code tool's) into
  `stats` (the sampler's shared counters, written to TensorBoard)."""
  code_env.publish(stats)
