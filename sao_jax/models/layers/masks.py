"""Positions and the attention mask, described by segment ids and slots.

The mask is never built by the model as a [B, T, S] array: it is described
by a `MaskSpec` (docs/design/models.md "Attention"): every query and every key
carries a segment id and a slot, and

    query t sees key s  iff  q_segment[t] == kv_segment[s]  and  s <= q_slot[t]
                             (and q_slot[t] - s < window, when window > 0).

`window` is a sliding window (Mistral, Gemma's local layers): the convention
of transformers' `sliding_window_overlay` (query index - key index < window,
counted in slots). Slots and positions agree within a segment: real tokens
of a row are contiguous in the trainer's rows, in left-padded prefill and in
the sampler's cache (each chunk is written at the row's end of real tokens).

Real tokens carry their (positive) segment id; padding carries the unique id
``-1 - slot``, so a padding query sees only its own slot (finite softmax,
equal with or without a cache) and no real query ever sees padding. Each
attention implementation turns the spec into what it needs: the dense
reference materialises the [B, T, S] mask, the blockwise path builds one
[bq, bkv] block at a time, splash attention takes the segment ids.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from sao_jax.models.layers.kv_cache import KVCache
from sao_jax.models.layers.kv_cache import write

Array = jax.Array


@flax.struct.dataclass
class MaskSpec:
  """Which keys each query sees (module docstring); keys are at slots 0..S-1.

  Attributes:
    q_segment: int32[B, T] segment id of each query (padding: -1 - slot).
    kv_segment: int32[B, S] segment id of each key slot (padding: -1 - slot).
    q_slot: int32[B, T] the key slot each query occupies.
    window: sliding window: a query sees keys fewer than `window` slots
      back, itself included; 0 = no window (`ModelConfig.sliding_window`; the
      attention layer sets it). A Python int, or under a layer scan with
      per-layer windows (`ModelConfig.layer_types`) a traced int32 scalar.
  """

  q_segment: Array
  kv_segment: Array
  q_slot: Array
  window: int = flax.struct.field(pytree_node=False, default=0)

  @property
  def kv_len(self) -> int:
    return self.kv_segment.shape[1]


def positions_from_mask(mask: Array) -> Array:
  """RoPE positions for (left-)padded rows: cumsum(mask) - 1, clipped at 0."""
  return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def _with_padding_ids(segment: Array, slot: Array) -> Array:
  """Segment ids where padding (id <= 0) gets its own id -1 - slot."""
  return jnp.where(segment > 0, segment, -1 - slot).astype(jnp.int32)


def mask_spec(attention_mask: Array, cache: KVCache | None,
              segment_ids: Array | None = None) -> tuple[MaskSpec, Array]:
  """The `MaskSpec` of a forward pass, and the slot validity bool[B, S].

  Args:
    attention_mask: bool[B, T] real (non-padding) tokens.
    cache: None (training: the T tokens are all the keys) or the KV cache
      the T tokens are written into at slots end + [0, T); its valid slots
      form one segment (one episode per row), `segment_ids` is not used.
    segment_ids: optional int32[B, T] (no cache): 0 on padding, 1, 2, ...
      for the trajectories packed into a row; None means one trajectory per
      row, `attention_mask.astype(int32)`.
  """
  attention_mask = attention_mask.astype(jnp.bool_)
  b, t = attention_mask.shape
  if cache is None:
    seg = (attention_mask.astype(jnp.int32) if segment_ids is None else
           jnp.where(attention_mask, segment_ids, 0).astype(jnp.int32))
    q_slot = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    seg = _with_padding_ids(seg, q_slot)
    return MaskSpec(q_segment=seg, kv_segment=seg, q_slot=q_slot), \
        attention_mask
  if segment_ids is not None:
    raise ValueError(
        "segment_ids was given with a KV cache: a cache holds one episode per "
        "row; pass segment_ids=None when decoding.")
  valid = write(cache.valid, attention_mask, cache.end)
  q_slot = jnp.broadcast_to(
      (cache.end[..., None] + jnp.arange(t)).astype(jnp.int32), (b, t))
  kv_slot = jnp.arange(valid.shape[1], dtype=jnp.int32)
  spec = MaskSpec(
      q_segment=_with_padding_ids(attention_mask.astype(jnp.int32), q_slot),
      kv_segment=_with_padding_ids(valid.astype(jnp.int32), kv_slot[None]),
      q_slot=q_slot)
  return spec, valid


def block_mask(q_segment: Array, q_slot: Array, kv_segment: Array,
               kv_slot: Array, window: int = 0) -> Array:
  """bool[B, Tq, Sk]: the rule of the module docstring on one block.

  q_segment, q_slot: int32[B, Tq]; kv_segment: int32[B, Sk]; kv_slot:
  int32[Sk] or [B, Sk]; window: sliding window (0: none).
  """
  same = q_segment[:, :, None] == kv_segment[:, None, :]
  mask = same & (kv_slot[..., None, :] <= q_slot[:, :, None])
  if isinstance(window, int):  # Static: 0 is no window.
    if window:
      mask &= q_slot[:, :, None] - kv_slot[..., None, :] < window
    return mask
  # Traced (a scanned layer's own window, 0 on global layers).
  near = q_slot[:, :, None] - kv_slot[..., None, :] < window
  return mask & ((window <= 0) | near)


def dense_mask(spec: MaskSpec) -> Array:
  """bool[B, T, S], materialised (the dense reference path only)."""
  kv_slot = jnp.arange(spec.kv_len, dtype=jnp.int32)
  return block_mask(spec.q_segment, spec.q_slot, spec.kv_segment, kv_slot,
                    spec.window)
