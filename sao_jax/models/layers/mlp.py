"""Gated MLPs."""

from __future__ import annotations

import flax.linen as nn
import jax

from sao_jax.models.config import ModelConfig
from sao_jax.models.layers.base import INIT_STD
from sao_jax.models.layers.base import param

Array = jax.Array


class MLP(nn.Module):
  """Gated MLP: down(act(gate(x)) * up(x)); act is `mlp_activation` (SiLU:
  SwiGLU; 'gelu_tanh': Gemma's GeGLU with the tanh approximation)."""

  config: ModelConfig
  features: int = 0  # Hidden width; 0: intermediate_size.

  @nn.compact
  def __call__(self, x: Array) -> Array:
    cfg = self.config
    init = nn.initializers.normal(INIT_STD)
    f = self.features or cfg.intermediate_size
    shape_in, shape_out = (cfg.hidden_size, f), (f, cfg.hidden_size)
    gate = param(self, "gate_proj", init, shape_in, ("embed", "mlp"))
    up = param(self, "up_proj", init, shape_in, ("embed", "mlp"))
    down = param(self, "down_proj", init, shape_out, ("mlp", "embed"))
    act = (jax.nn.silu if cfg.mlp_activation == "silu" else
           lambda y: jax.nn.gelu(y, approximate=True))
    hdn = act(x @ gate.astype(x.dtype)) * (x @ up.astype(x.dtype))
    hdn = nn.with_logical_constraint(hdn, ("batch", "length", "mlp"))
    return hdn @ down.astype(x.dtype)
