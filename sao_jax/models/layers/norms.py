"""Normalisation layers."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.models.config import ModelConfig
from sao_jax.models.layers.base import param

Array = jax.Array


class RMSNorm(nn.Module):
  """y = x / sqrt(mean(x^2) + eps) * scale, in float32 (HF LlamaRMSNorm);
  * (1 + scale) with `norm_style` 'gemma' or 'qwen3_5' (HF Gemma3RMSNorm,
  Qwen3_5RMSNorm; scale init 0).

  Over the last axis: `features` wide (0: hidden_size), logical `axis`
  (Qwen3's per-head q/k norms: head_dim, 'head_dim'); or over the last
  len(features) axes when `features` and `axis` are tuples (OLMo 2's
  full-width q/k norms: (heads, head_dim), one mean over every channel).
  `with_scale=False`: no weight (Gemma 4's value norm).
  """

  config: ModelConfig
  features: int | tuple[int, ...] = 0
  axis: str | tuple[str, ...] = "embed"
  eps: float = 0.0  # 0: the config's rms_norm_eps.
  with_scale: bool = True

  @nn.compact
  def __call__(self, x: Array) -> Array:
    gemma = self.config.norm_style in ("gemma", "qwen3_5")  # (1 + w).
    init = nn.initializers.zeros if gemma else nn.initializers.ones
    shape = self.features or self.config.hidden_size
    shape = tuple(shape) if isinstance(shape, tuple) else (shape,)
    axes = self.axis if isinstance(self.axis, tuple) else (self.axis,)
    x32 = x.astype(jnp.float32)
    over = tuple(range(-len(shape), 0))
    x32 = x32 * jax.lax.rsqrt(
        jnp.mean(x32 * x32, axis=over, keepdims=True) +
        (self.eps or self.config.rms_norm_eps))
    if not self.with_scale:
      return x32.astype(self.config.compute_dtype)
    scale = param(self, "scale", init, shape, axes)
    w = scale.astype(jnp.float32) + (1.0 if gemma else 0.0)
    return (w * x32).astype(self.config.compute_dtype)
