"""Positions and attention masks of (left-)padded rows, with or without a cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sao_jax.models.layers.kv_cache import KVCache
from sao_jax.models.layers.kv_cache import write

Array = jax.Array


def positions_from_mask(mask: Array) -> Array:
  """RoPE positions for (left-)padded rows: cumsum(mask) - 1, clipped at 0."""
  return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def attention_mask(attention_mask: Array, cache: KVCache | None):
  """bool[B,T,S]: query t sees slot s iff s is valid and s <= slot(t).

  Also returns the updated slot validity bool[B,S].
  """
  t = attention_mask.shape[1]
  if cache is None:
    valid, q_slot = attention_mask, jnp.arange(t)
  else:
    valid = write(cache.valid, attention_mask, cache.end)
    q_slot = cache.end[..., None] + jnp.arange(t)  # [T] or [B, T].
  q_slot = jnp.broadcast_to(q_slot, attention_mask.shape)[..., None]
  slots = jnp.arange(valid.shape[1])
  causal = slots <= q_slot  # [B, T, S]
  # A query always sees its own slot: for real tokens that changes nothing;
  # padding queries then attend only to themselves (finite, causal, and equal
  # with or without a cache) instead of to an arbitrary set of slots.
  own = slots == q_slot
  return (valid[:, None, :] & causal) | own, valid
