"""Gemma 4's per-layer embeddings (PLE; `ModelConfig.per_layer_input_size`).

Each of the L layers gets its own P-wide input per token
(`PerLayerEmbedding`, once per forward): (norm(E W_p / sqrt(D)) + T[id] *
sqrt(P)) / sqrt(2), with E the (scaled) token embeddings, W_p [D, L * P]
and T a [vocab, L * P] table, norm an RMSNorm over each layer's P channels.
A layer adds, after its MLP (`PerLayerInput`), norm(W_o (gelu(W_g x) *
input)) with W_g [D, P], W_o [P, D] (HF Gemma4TextModel.get_per_layer_inputs,
project_per_layer_inputs and the decoder layer's per_layer_input_gate /
per_layer_projection / post_per_layer_input_norm).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.models.config import ModelConfig
from sao_jax.models.layers.base import INIT_STD
from sao_jax.models.layers.base import param
from sao_jax.models.layers.norms import RMSNorm

Array = jax.Array


class PerLayerEmbedding(nn.Module):
  """tokens [B, T], embeddings x [B, T, D] -> per-layer inputs [B, T, L, P]."""

  config: ModelConfig

  @nn.compact
  def __call__(self, tokens: Array, x: Array) -> Array:
    cfg = self.config
    d, n, p = cfg.hidden_size, cfg.num_layers, cfg.per_layer_input_size
    init = nn.initializers.normal(INIT_STD)
    table = param(self, "embedding", init, (cfg.vocab_size, n * p),
                  ("vocab", None))
    proj = param(self, "projection", init, (d, n * p), ("embed", None))
    dtype = cfg.compute_dtype
    ids = jnp.take(table, tokens, axis=0).astype(dtype) * jnp.asarray(
        p ** 0.5, dtype)
    ctx = (x @ proj.astype(x.dtype)) * jnp.asarray(d ** -0.5, x.dtype)
    ctx = RMSNorm(cfg, p, None, name="norm")(ctx.reshape(*x.shape[:2], n, p))
    return (ctx + ids.reshape(*x.shape[:2], n, p)) * jnp.asarray(
        2 ** -0.5, dtype)


class PerLayerInput(nn.Module):
  """What a layer adds to x [B, T, D] from its per-layer input [B, T, P]."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, ple: Array) -> Array:
    cfg = self.config
    d, p = cfg.hidden_size, cfg.per_layer_input_size
    init = nn.initializers.normal(INIT_STD)
    gate = param(self, "gate", init, (d, p), ("embed", None))
    out = param(self, "projection", init, (p, d), (None, "embed"))
    y = jax.nn.gelu(x @ gate.astype(x.dtype), approximate=True) * ple.astype(
        x.dtype)
    return RMSNorm(cfg, name="post_norm")(y @ out.astype(x.dtype)).astype(
        x.dtype)
