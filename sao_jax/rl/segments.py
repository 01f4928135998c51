"""Per-trajectory views of packed ``[B, T]`` rows (pure jnp, jit-safe).

A packed row (``sao_jax.data.packing``, docs/design/data_path.md "Packed rows")
holds up to ``S`` trajectories back to back: ``segment_ids`` int32[B, T] is 0 on
padding and 1..S on the tokens of the row's trajectories in order, and slot
``s`` of the ``[B, S]`` per-trajectory fields describes segment ``s + 1``. An
unpacked row is the special case ``segment_ids = attention_mask``, ``S = 1``.

These helpers turn token arrays into per-trajectory sums ``[B, S]``, spread
per-trajectory values back over tokens, and mark the first and last token of
each segment, so the estimators and losses never mix two trajectories.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def segment_ends(segment_ids: Array) -> Array:
  """bool[B, T]: token t is the last of its segment (the next token belongs
  to another segment, or t is the row's last slot)."""
  seg = jnp.asarray(segment_ids)
  nxt = jnp.pad(seg[:, 1:], ((0, 0), (0, 1)), constant_values=-1)
  return seg != nxt


def segment_starts(segment_ids: Array) -> Array:
  """bool[B, T]: token t is the first of its segment."""
  seg = jnp.asarray(segment_ids)
  prev = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  return seg != prev


def shift_right_within(x: Array, segment_ids: Array) -> Array:
  """out[:, t] = x[:, t − 1] inside a segment, 0 on each segment's first
  token (what token t−1 said about token t never crosses a boundary)."""
  shifted = jnp.pad(x[:, :-1], ((0, 0), (1, 0)))
  return jnp.where(segment_starts(segment_ids), jnp.zeros_like(shifted),
                   shifted)


def segment_sum(x: Array, segment_ids: Array, num_slots: int) -> Array:
  """Σ of ``x`` [B, T] over each segment -> [B, S] (padding dropped)."""
  seg = jnp.asarray(segment_ids, jnp.int32)
  b = seg.shape[0]
  flat = jnp.where(seg > 0, jnp.arange(b)[:, None] * num_slots + seg - 1,
                   b * num_slots)  # Padding goes past the end: dropped.
  out = jax.ops.segment_sum(jnp.asarray(x).reshape(-1), flat.reshape(-1),
                            num_segments=b * num_slots)
  return out.reshape(b, num_slots)


def to_tokens(slot_values: Array, segment_ids: Array) -> Array:
  """Spreads ``[B, S]`` per-trajectory values over their tokens -> [B, T]
  (0 on padding)."""
  seg = jnp.asarray(segment_ids, jnp.int32)
  idx = jnp.maximum(seg - 1, 0)
  vals = jnp.take_along_axis(jnp.asarray(slot_values), idx, axis=1)
  return jnp.where(seg > 0, vals, jnp.zeros_like(vals))
