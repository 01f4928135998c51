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
  * (1 + scale) with `norm_style='gemma'` (HF Gemma3RMSNorm, scale init 0).

  Over the last axis: `features` wide (0: hidden_size), logical `axis`
  (Qwen3's per-head q/k norms: head_dim, 'head_dim').
  """

  config: ModelConfig
  features: int = 0
  axis: str = "embed"

  @nn.compact
  def __call__(self, x: Array) -> Array:
    gemma = self.config.norm_style == "gemma"
    init = nn.initializers.zeros if gemma else nn.initializers.ones
    scale = param(self, "scale", init,
                   (self.features or self.config.hidden_size,), (self.axis,))
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(
        jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.config.rms_norm_eps)
    w = scale.astype(jnp.float32) + (1.0 if gemma else 0.0)
    return (w * x32).astype(self.config.compute_dtype)
