"""Masked statistics over ``[B, T]`` token arrays (pure jnp, jit-safe).

Every reduction takes a ``mask`` (1 on action tokens, 0 on prompt, padding and
environment observations) and is NaN-free when the mask is all zero: empty sums
divide by ``max(count, 1)`` and empty min/max return 0. Masked-out entries never
influence a result, even when they hold NaN or inf (they are replaced with
``jnp.where`` before any arithmetic, so no NaN can leak through ``0 * NaN``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def as_mask(mask: Array) -> Array:
  """Returns ``mask`` as float32 0/1 (from bool, uint8, int or float masks)."""
  return (jnp.asarray(mask) != 0).astype(jnp.float32)


def masked_sum(x: Array, mask: Array, axis=None) -> Array:
  """Σ mask·x, with masked-out entries ignored even if non-finite."""
  m = as_mask(mask)
  return jnp.sum(jnp.where(m > 0, x, 0.0), axis=axis)


def masked_count(mask: Array, axis=None) -> Array:
  """Σ mask (as float32)."""
  return jnp.sum(as_mask(mask), axis=axis)


def masked_mean(x: Array, mask: Array, axis=None) -> Array:
  """Σ mask·x / max(Σ mask, 1); 0 for an empty mask."""
  return masked_sum(x, mask, axis) / jnp.maximum(masked_count(mask, axis), 1.0)


def masked_var(x: Array, mask: Array, axis=None, ddof: int = 0) -> Array:
  """Masked variance Σ mask·(x − mean)² / max(Σ mask − ddof, 1); 0 if empty."""
  mean = masked_mean(x, mask, axis)
  if axis is not None:
    mean = jnp.expand_dims(mean, axis)
  sq = jnp.square(jnp.where(as_mask(mask) > 0, x - mean, 0.0))
  denom = jnp.maximum(masked_count(mask, axis) - ddof, 1.0)
  return jnp.sum(sq, axis=axis) / denom


def masked_min(x: Array, mask: Array) -> Array:
  """Minimum of x over mask==1 (whole array); 0 for an empty mask."""
  m = as_mask(mask) > 0
  val = jnp.min(jnp.where(m, x, jnp.inf))
  return jnp.where(jnp.any(m), val, 0.0)


def masked_max(x: Array, mask: Array) -> Array:
  """Maximum of x over mask==1 (whole array); 0 for an empty mask."""
  m = as_mask(mask) > 0
  val = jnp.max(jnp.where(m, x, -jnp.inf))
  return jnp.where(jnp.any(m), val, 0.0)


def masked_whiten(x: Array, mask: Array, eps: float = 1e-8,
                  shift_mean: bool = True) -> Array:
  """(x − mean)/(std + eps) over mask==1 (population std); 0 off the mask.

  The batch normaliser of REINFORCE++ (Hu 2025): statistics over every action
  token of the batch.
  """
  m = as_mask(mask)
  mean = masked_mean(x, m)
  std = jnp.sqrt(masked_var(x, m))
  centred = x - mean if shift_mean else x
  return jnp.where(m > 0, centred / (std + eps), 0.0)


def explained_variance(values: Array, returns: Array, mask: Array) -> Array:
  """1 − Var(R − V)/Var(R) over action tokens (SAO §3.2 critic diagnostic).

  Returns 0 when Var(R) is ~0 (≤ 1e-8: an empty mask or constant returns, up
  to float32 rounding), where the ratio is undefined; 1 means a perfect
  critic, ≤ 0 a critic no better than the mean.
  """
  var_r = masked_var(returns, mask)
  var_res = masked_var(returns - values, mask)
  defined = var_r > 1e-8
  safe = jnp.where(defined, var_r, 1.0)
  return jnp.where(defined, 1.0 - var_res / safe, 0.0)
