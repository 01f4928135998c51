"""Trainer-side token log-probs: one full forward, log-softmax, shifted.

The sampler records `log_softmax(logits / T)[token]` for each token it samples
(`sao_jax.sampler.sampling`); these functions compute the same quantity from a
full (cache-free) forward over the finished sequence, so the SAO importance
ratio r_t = exp(logp_t - rollout_logp_t) (docs/DESIGN.md §2, Eq. 1) is 1
on-policy.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.models.config import ModelConfig
from sao_jax.models.transformer import positions_from_mask
from sao_jax.models.transformer import Transformer

Array = jax.Array


def unwrap_params(params: Any) -> Any:
  """The plain `Transformer` params tree from params or `{'params': ...}`."""
  if "params" in params and "decoder" not in params:
    params = params["params"]
  return nn.unbox(params)


def logprobs_from_logits(logits: Array, tokens: Array,
                         temperature: float = 1.0) -> Array:
  """out[:, t] = log_softmax(logits[:, t-1] / T)[tokens[:, t]]; out[:, 0] = 0.

  Args:
    logits: float [B, T, V] next-token logits (position t predicts t+1).
    tokens: int [B, T] the sequence the logits were computed on.
    temperature: the sampling temperature (> 0).

  Returns:
    float32 [B, T] log-probs aligned with `tokens` (as `Trajectory.rollout_logp`).
  """
  logp = jax.nn.log_softmax(
      logits[:, :-1].astype(jnp.float32) / jnp.float32(temperature), axis=-1)
  picked = jnp.take_along_axis(logp, tokens[:, 1:, None].astype(jnp.int32),
                               axis=-1)[..., 0]
  return jnp.pad(picked, ((0, 0), (1, 0)))


@functools.partial(jax.jit, static_argnames=("config", "temperature"))
def token_logprobs(params: Any, config: ModelConfig, tokens: Array,
                   attention_mask: Array, temperature: float = 1.0) -> Array:
  """Full-forward log-prob of every token given its prefix, float32 [B, T].

  Positions come from `positions_from_mask(attention_mask)`, as in the sampler
  (padding anywhere in a row is skipped). Entries at t = 0 and on padding are
  meaningless; mask them with the trajectory's action mask.

  Args:
    params: `Transformer` params (plain, boxed or `{'params': ...}`).
    config: the model config.
    tokens: int32 [B, T].
    attention_mask: bool [B, T], True on real tokens.
    temperature: the temperature the tokens were sampled at.
  """
  mask = attention_mask.astype(jnp.bool_)
  logits, _ = Transformer(config).apply(
      {"params": unwrap_params(params)}, tokens, positions_from_mask(mask),
      mask)
  return logprobs_from_logits(logits, tokens, temperature)
