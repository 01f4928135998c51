"""The sampler's copy of the policy, in the precision it generates with.

The trainer keeps its master weights in ``model.param_dtype`` (float32 for
AdamW); a decode step reads every weight once, so generation wants them in
the compute dtype. ``sampler.param_dtype`` ('' = ``model.dtype``) is the
dtype of the sampler's copy: the trainer casts its policy on its own devices
before publishing (``caster``), so the weight slot, the held-back versions
and what crosses to the sampler (and each host's DCN share on a pod) are in
that dtype (bfloat16: half of float32), and the sampler's template, programs
and memory figures follow from ``sampler_model_config``. Integer leaves are
never cast. The log-probability gap this opens between the sampler and the
float32 trainer is what the double-sided importance mask (DIS, the paper's
Eqs. 1-3) is for; ``policy/logp_abs_diff`` and ``policy/dis_band_out_frac``
measure it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from sao_jax import ranges
from sao_jax.models import config as model_config_lib

# config_validation checks sampler.<field> with these ('' follows
# model.dtype).
FIELD_RULES = {
    "param_dtype": ranges.one_of(("",) + model_config_lib.DTYPES,
                                 "'' (model.dtype) or one of"),
}


def param_dtype(config: Any, mcfg: model_config_lib.ModelConfig) -> str:
  """The dtype of the sampler's weights: ``sampler.param_dtype``, or the
  model's compute dtype when it is ''."""
  name = str(config.sampler.get("param_dtype", "")) or str(mcfg.dtype)
  if name not in model_config_lib.DTYPES:
    raise ValueError(
        f"config.sampler.param_dtype: expected '' (model.dtype) or one of "
        f"{model_config_lib.DTYPES}, got {name!r}")
  return name


def sampler_model_config(config: Any, mcfg: model_config_lib.ModelConfig
                         ) -> model_config_lib.ModelConfig:
  """``mcfg`` with the sampler's parameter dtype: what the sampler process,
  its AOT programs and the weight slot's size are built from."""
  return dataclasses.replace(mcfg, param_dtype=param_dtype(config, mcfg))


def cast_params(params: Any, dtype: str) -> Any:
  """Floating leaves of ``params`` in ``dtype``; other leaves unchanged."""
  target = jnp.dtype(dtype)
  return jax.tree.map(
      lambda x: x.astype(target) if jnp.issubdtype(x.dtype, jnp.floating)
      else x, params)


def caster(dtype: str) -> Callable[[Any], Any]:
  """``params -> params`` in ``dtype``, jitted with each leaf's own sharding
  as its output's: it runs where the params are, so nothing is gathered in
  the trainer's precision. The identity (no copy) when every floating leaf
  already has that dtype."""
  target = jnp.dtype(dtype)

  @functools.lru_cache(maxsize=4)
  def compiled(treedef, shardings):
    return jax.jit(lambda p: cast_params(p, dtype),
                   out_shardings=jax.tree.unflatten(treedef, shardings))

  def apply(params: Any) -> Any:
    leaves, treedef = jax.tree.flatten(params)
    if all(x.dtype == target for x in leaves
           if jnp.issubdtype(x.dtype, jnp.floating)):
      return params
    return compiled(treedef, tuple(x.sharding for x in leaves))(params)

  return apply
