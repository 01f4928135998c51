"""Parameter creation shared by the layers: logical axes, params dtype, init."""

from __future__ import annotations

import flax.linen as nn
import jax

Array = jax.Array


INIT_STD = 0.02  # HF `initializer_range`.


def param(module: nn.Module, name: str, init, shape, names) -> Array:
  """A parameter with logical axis ``names`` in the config's params dtype."""
  cfg = module.config
  return module.param(
      name, nn.with_logical_partitioning(init, names), shape, cfg.params_dtype)
