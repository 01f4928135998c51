"""A tiny `ModelConfig` for tests that build a model from scratch, and its
parameters made by one compiled program.

The shape most unit tests share: vocabulary 32, width 32 (MLP 64), 2 layers
of 4 query heads (2 KV heads) of size 8; it compiles in seconds on a CPU.
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sao_jax.models import transformer
from sao_jax.models.config import ModelConfig

TINY_MODEL = dict(vocab_size=32, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)


def tiny_model_config(**overrides: Any) -> ModelConfig:
  """The tiny model's config; `overrides` replace (or add) fields."""
  return ModelConfig(**{**TINY_MODEL, **overrides})


def init_params(module: nn.Module, key: jax.Array, *args: Any,
                unbox: bool = True, **kwargs: Any) -> Any:
  """`module.init(key, *args, **kwargs)` (unboxed unless `unbox=False`) as
  one jitted program.

  Eager `init` runs op by op, and on the CPU backend each op is a compile of
  its own: about twice the CPU time of compiling the whole init once.
  """
  def init(k, *a):
    variables = module.init(k, *a, **kwargs)
    return nn.unbox(variables) if unbox else variables
  return jax.jit(init)(key, *args)


@functools.cache
def policy_and_critic(cfg: ModelConfig) -> tuple[Any, Any]:
  """Policy params of a `Transformer(cfg)` (key 0) and its critic's (the
  backbone's copy and a head, key 1), made once per process and config by
  jitted programs. A step that donates its state must get copies."""
  tok = jnp.zeros((1, 4), jnp.int32)
  p = init_params(transformer.Transformer(cfg), jax.random.PRNGKey(0), tok,
                  tok, tok > -1)["params"]
  v = jax.jit(functools.partial(transformer.value_params_from_policy,
                                config=cfg))(p, rng=jax.random.PRNGKey(1))
  return p, v
