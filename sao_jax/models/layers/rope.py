"""Rotary position embeddings."""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def apply_rope(x: Array, positions: Array, theta: float,
               rotary_dim: int = 0) -> Array:
  """Rotary embedding, HF layout: x*cos + rotate_half(x)*sin.

  Args:
    x: [B, T, H, Dh].
    positions: int32[B, T].
    theta: base frequency.
    rotary_dim: rotate only the first rotary_dim channels of each head and
      pass the rest through (GLM's partial rotary); 0 rotates all Dh.
  """
  if rotary_dim and rotary_dim < x.shape[-1]:
    return jnp.concatenate([apply_rope(x[..., :rotary_dim], positions, theta),
                            x[..., rotary_dim:]], axis=-1)
  dh = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(emb), jnp.sin(emb)
  x32 = x.astype(jnp.float32)
  x1, x2 = jnp.split(x32, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  return (x32 * cos + rotated * sin).astype(x.dtype)
