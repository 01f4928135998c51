"""Token embedding and the tied output projection."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.models.config import ModelConfig
from sao_jax.models.layers.base import INIT_STD
from sao_jax.models.layers.base import param

Array = jax.Array


class Embedder(nn.Module):
  """Token embedding (* sqrt(hidden_size) with `norm_style` 'gemma' or
  'gemma4', in the compute dtype as HF Gemma3TextScaledWordEmbedding);
  `attend` is the tied output projection (unscaled)."""

  config: ModelConfig

  def setup(self):
    cfg = self.config
    self.embedding = param(
        self, "embedding", nn.initializers.normal(INIT_STD),
        (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"))

  def __call__(self, tokens: Array) -> Array:
    cfg = self.config
    x = jnp.take(self.embedding, tokens, axis=0).astype(cfg.compute_dtype)
    if cfg.norm_style in ("gemma", "gemma4"):
      x = x * jnp.asarray(cfg.hidden_size ** 0.5, cfg.compute_dtype)
    return x

  def attend(self, x: Array) -> Array:
    return jnp.einsum("btd,vd->btv", x, self.embedding.astype(x.dtype),
                      preferred_element_type=jnp.float32)
