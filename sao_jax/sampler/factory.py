"""Builds the rollout engine a config names (``sampler.engine``).

The one place that knows every engine: the sampler process and the
evaluation ask for a `interface.Rollout` here and drive it through that
interface only.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

from sao_jax.tokenization import tokenizer as tok_lib
from sao_jax.envs.base import Environment
from sao_jax.models.config import ModelConfig
from sao_jax.sampler import engine as engine_lib
from sao_jax.sampler import interface
from sao_jax.sampler import vllm_engine

ENGINES = ("native", "vllm")


def make_rollout(config: Any, *, model_config: ModelConfig,
                 tokenizer: tok_lib.Tokenizer, envs: Sequence[Environment],
                 weights: interface.WeightSource, stats, rng: jax.Array,
                 settings: interface.RolloutSettings | None = None,
                 engine: str | None = None) -> interface.Rollout:
  """The engine ``engine`` (default ``config.sampler.engine``), built.

  Args:
    config: the experiment config.
    model_config: the policy's architecture.
    tokenizer: the run's tokenizer (its stop tokens, its chat template).
    envs: one environment per slot (``options.num_slots``).
    weights: the newest published weights.
    stats: a `SamplerStats`.
    rng: PRNG key of the sampling noise.
    settings: default ``interface.RolloutSettings.from_config(config)``.
    engine: one of `ENGINES`.
  """
  name = str(config.sampler.engine) if engine is None else engine
  if settings is None:
    settings = interface.RolloutSettings.from_config(config)
  if name == "native":
    return engine_lib.NativeRollout(
        settings, model_config=model_config, tokenizer=tokenizer, envs=envs,
        weights=weights, stats=stats, rng=rng)
  if name == "vllm":
    return vllm_engine.VllmRollout(
        settings, config=config, model_config=model_config,
        tokenizer=tokenizer, envs=envs, weights=weights, stats=stats,
        seed=int(jax.random.randint(rng, (), 0, 2**31 - 1)))
  raise ValueError(f"sampler.engine={name!r}: expected one of {ENGINES}.")


def check_config(config: Any) -> None:
  """Refuses an unknown ``sampler.engine``, and the settings an engine
  cannot honour (with the reason), at config time."""
  name = str(config.sampler.engine)
  if name not in ENGINES:
    raise ValueError(f"config.sampler.engine={name!r}: expected one of "
                     f"{ENGINES}.")
  if name == "vllm":
    vllm_engine.check_config(config)
