"""Held-out evaluation: greedy episodes on tasks whose seeds training never sees.

Runs the same episode runner and environments as the sampler, with greedy
decoding and the current policy params, in the trainer process. Accuracy is
the share of problems whose answer gets reasoning-gym's full credit
(``score_answer`` = 1; the 'exact' reward rule), whatever partial credit the
training reward (``env.reward``) pays.
"""

from __future__ import annotations

import time
from typing import Any

from absl import logging
import jax
import numpy as np

from sao_jax.tokenization import tokenizer as tok_lib
from sao_jax.envs import build as env_build
from sao_jax.envs.reasoning_gym_env import ReasoningGymTasks
from sao_jax.models.config import ModelConfig
from sao_jax.sampler import rollout
from sao_jax.sampler.sampling import SamplingParams
from sao_jax.data.trajectory import FinishReason


def evaluate(params: Any, model_config: ModelConfig, config: Any,
             tokenizer: tok_lib.Tokenizer, tasks: ReasoningGymTasks,
             *, version: int = 0, batch_size: int = 64) -> dict[str, float]:
  """Greedy held-out accuracy and episode statistics.

  Args:
    params: Policy params.
    model_config: Policy architecture.
    config: The full experiment config (env, sampler limits).
    tokenizer: The tokenizer.
    tasks: Held-out tasks (``build_tasks(...)[1]``).
    version: Policy version (the evolving env's required style depends on it).
    batch_size: Episodes decoded together.

  Returns:
    ``eval/accuracy`` (mean score), ``eval/num_problems``, ``eval/mean_length``
    (action tokens), ``eval/stop_frac``, ``eval/error_frac``, ``eval/seconds``.
  """
  t0 = time.perf_counter()
  limits = rollout.RolloutLimits.from_config(config)
  greedy = SamplingParams(greedy=True)
  n = len(tasks)
  bs = min(batch_size, n)
  envs = env_build.make_envs(config.env, tasks, bs, reward="exact")
  scores, lengths, stops, errors = [], [], [], []
  for start in range(0, n, bs):
    ids = list(range(start, min(n, start + bs)))
    ids += [ids[-1]] * (bs - len(ids))  # Pad the last batch (fixed shapes).
    policy = rollout.ModelPolicy(model_config, lambda: (params, version),
                                 limits.cache_len(), greedy,
                                 rng=jax.random.PRNGKey(0),
                                 min_bucket=limits.min_prompt_bucket,
                                 # One-off greedy batches: fewer shapes to
                                 # compile beats running fewer rows.
                                 row_subsets=False)
    trajs = rollout.run_episodes(policy, envs, ids, tokenizer, limits)
    for traj in trajs[:min(n, start + bs) - start]:
      scores.append(traj.total_reward)
      lengths.append(traj.num_action_tokens)
      stops.append(traj.finish_reason == FinishReason.STOP)
      errors.append(traj.finish_reason == FinishReason.ERROR)
    logging.info("eval (v%d): %d/%d problems, accuracy so far %.3f, %.0f s",
                 version, len(scores), n, float(np.mean(scores)),
                 time.perf_counter() - t0)
  return {
      "eval/accuracy": float(np.mean(scores)),
      "eval/num_problems": float(n),
      "eval/mean_length": float(np.mean(lengths)),
      "eval/stop_frac": float(np.mean(stops)),
      "eval/error_frac": float(np.mean(errors)),
      "eval/seconds": time.perf_counter() - t0,
  }
