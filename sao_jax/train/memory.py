"""Memory estimate of a run: params, both optimizer states, critic, KV cache.

A pure function of the model config and a few run settings, logged when a run
starts (`log_memory_estimate`) so a real-size config shows what it will need
before it allocates it. Counts what the trainer holds (policy and critic
params in `param_dtype`, AdamW's two moments per trainable parameter in the
same dtype, none for the critic's frozen attention leaves) and the sampler's
KV cache (keys and values of every layer, `compute dtype`). Activations and
the sampler's own copy of the policy are not counted. The figures do not
depend on the layer layout (`scan_layers` stacks the same leaves; the KV
cache is [L, ...] in both).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from absl import logging
import jax
import numpy as np

from sao_jax.models.config import ModelConfig
from sao_jax.models.layers import kv_cache

_ADAM_MOMENTS = 2  # AdamW keeps mu and nu per trainable parameter.


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
  """Bytes per item."""

  policy_params: int
  policy_optimizer: int
  critic_params: int
  critic_optimizer: int
  kv_cache: int

  @property
  def total(self) -> int:
    return sum(dataclasses.asdict(self).values())

  def summary(self) -> str:
    parts = [f"{k}={v / 2**20:,.1f} MiB"
             for k, v in dataclasses.asdict(self).items()]
    return ", ".join(parts) + f"; total={self.total / 2**30:,.2f} GiB"


def attention_params(config: ModelConfig) -> int:
  """Parameters `optim.frozen_attention_labels` freezes: every layer's q/k/v/o
  projections (and q/k/v biases, q/k norms; a linear-attention layer's
  `linear_attn`) and its attention norms (`attn_norm`, `post_attn_norm`)."""
  d = config.hidden_size
  per_layer = d  # attn_norm.
  if config.norm_style in ("gemma", "gemma4"):
    per_layer += d  # post_attn_norm (an 'attn' path).
  # norm_style 'olmo': post_attn_norm in place of attn_norm, as many.
  return sum(config.layer_attention_params(i) + per_layer
             for i in range(config.num_layers))


def critic_params(config: ModelConfig) -> int:
  """The critic: the policy's backbone (no output head) + a scalar head."""
  head = 0 if config.tie_embeddings else config.hidden_size * config.vocab_size
  return config.num_params() - head + config.hidden_size + 1


def estimate_memory(config: ModelConfig, *, kv_batch: int, kv_len: int,
                    critic: bool = True,
                    critic_frozen_attention: bool = False) -> MemoryEstimate:
  """Bytes of the trainer's state and the sampler's KV cache.

  Args:
    config: the model config (`param_dtype` for params and moments,
      `dtype` for the KV cache).
    kv_batch: rows decoded together by the sampler.
    kv_len: KV cache slots per row.
    critic: whether the run trains a critic (SAO, PPO: yes; GRPO: no).
    critic_frozen_attention: the critic's attention is frozen (no moments).
  """
  p = np.dtype(config.param_dtype).itemsize
  c = np.dtype(config.dtype).itemsize
  policy = config.num_params()
  value = critic_params(config) if critic else 0
  trainable_value = value - (
      attention_params(config) if critic and critic_frozen_attention else 0)
  attention_layers = config.num_layers - sum(
      map(config.is_linear_layer, range(config.num_layers)))
  kv = attention_layers * kv_batch * kv_len * c * sum(
      heads * width for heads, width in kv_cache.slot_widths(config))
  if config.hybrid:  # The linear layers' fixed-size states, per row.
    kv += sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
        jax.eval_shape(lambda: kv_cache.init_cache(config, kv_batch,
                                                   1)).linear))
  return MemoryEstimate(
      policy_params=policy * p,
      policy_optimizer=_ADAM_MOMENTS * policy * p,
      critic_params=value * p,
      critic_optimizer=_ADAM_MOMENTS * trainable_value * p,
      kv_cache=kv)


def log_memory_estimate(config: Any, model_config: ModelConfig
                        ) -> MemoryEstimate:
  """Logs `estimate_memory` for an experiment config; returns it."""
  from sao_jax.sampler import rollout  # pylint: disable=g-import-not-at-top

  # The loop builds the critic for every advantage estimator.
  est = estimate_memory(
      model_config, kv_batch=int(config.sampler.batch_size),
      kv_len=rollout.RolloutLimits.from_config(config).cache_len(),
      critic_frozen_attention=bool(config.rl.critic_frozen_attention))
  logging.info("Memory estimate (%s params, sampler batch %d): %s",
               f"{model_config.num_params():,}",
               int(config.sampler.batch_size), est.summary())
  return est
