"""The sampler's KV cache: keys/values of every layer, per-row write ends."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from sao_jax.models.config import ModelConfig

Array = jax.Array


@flax.struct.dataclass
class KVCache:
  """Keys/values of every layer for generation.

  Attributes:
    k: [L, B, S, Hkv, Dh] rotated keys per slot; with MLA (layers/mla.py)
      [L, B, S, 1, kv_lora_rank], the normed key/value latent.
    v: [L, B, S, Hkv, Dh] values per slot; with MLA [L, B, S, 1,
      qk_rope_head_dim], the rotated RoPE key every head shares.
    valid: bool[B, S] slot holds a real (non-padding) token.
    end: int32, where the next tokens are written: a scalar shared by every
      row, or int32[B], one per row (the sampler's slots: each row is written
      and refilled on its own; `init_cache(per_row=True)`).
    linear: A hybrid decoder's linear-attention layers' state, else None:
      (S float32 [Llin, B, Hv, Dk, Dv], the q, k, v short-conv states
      [Llin, B, channels, K-1]; layers/linear_attention.py), by
      `kind_index`; k and v then hold the attention layers' only.
  """

  k: Array
  v: Array
  valid: Array
  end: Array
  linear: tuple[Array, ...] | None = None

  @property
  def max_len(self) -> int:
    return self.k.shape[2]


def slot_widths(config: ModelConfig) -> tuple[tuple[int, int],
                                              tuple[int, int]]:
  """(heads, width) of one slot of `KVCache.k` and of `KVCache.v`: the
  widest attention layer's (`ModelConfig.attention_dims`; narrower layers
  use the first heads and channels)."""
  if config.mla:
    return (1, config.kv_lora_rank), (1, config.qk_rope_head_dim)
  dims = [config.attention_dims(i) for i in range(config.num_layers)]
  kv = (max(h for h, _, _ in dims), max(d for _, d, _ in dims))
  return kv, kv


def kind_index(config: ModelConfig, i: int) -> int:
  """Layer i's index in the cache arrays of its kind: among the linear
  layers (`KVCache.linear`) or the attention layers (`KVCache.k`, `v`)."""
  linear = config.is_linear_layer(i)
  return sum(config.is_linear_layer(j) == linear for j in range(i))


def _linear_state(config: ModelConfig, batch_size: int) -> tuple[Array, ...]:
  """The zero (S, q, k, v conv) states of the linear layers."""
  n = sum(map(config.is_linear_layer, range(config.num_layers)))
  hk, dk = config.linear_num_key_heads, config.linear_key_head_dim
  hv, dv = config.linear_num_value_heads, config.linear_value_head_dim
  taps = config.linear_conv_kernel_dim - 1
  conv = lambda c: jnp.zeros((n, batch_size, c, taps), config.compute_dtype)
  return (jnp.zeros((n, batch_size, hv, dk, dv), jnp.float32),
          conv(hk * dk), conv(hk * dk), conv(hv * dv))


def init_cache(config: ModelConfig, batch_size: int, max_len: int,
               per_row: bool = False) -> KVCache:
  """An empty cache with `max_len` slots per row (one write end per row if
  ``per_row``)."""
  layers = config.num_layers - sum(
      map(config.is_linear_layer, range(config.num_layers)))
  lead = (layers, batch_size, max_len)
  k_slot, v_slot = slot_widths(config)
  return KVCache(
      linear=_linear_state(config, batch_size) if config.hybrid else None,
      k=jnp.zeros(lead + k_slot, config.compute_dtype),
      v=jnp.zeros(lead + v_slot, config.compute_dtype),
      valid=jnp.zeros((batch_size, max_len), jnp.bool_),
      end=jnp.zeros((batch_size,) if per_row else (), jnp.int32),
  )


def write(buf: Array, new: Array, end: Array, lead: tuple = ()) -> Array:
  """Writes new [B, T, ...] into buf[*lead, B, S, ...] at slots end + [0, T).

  A scalar ``end`` is one slice for every row; a per-row ``end`` [B] is a
  scatter, whose writes past the last slot are dropped (padding after a
  row's real tokens may overhang; the caller keeps real tokens in range).
  """
  new = new.astype(buf.dtype)
  if end.ndim == 0:
    start = (*lead, 0, end) + (0,) * (new.ndim - 2)
    return jax.lax.dynamic_update_slice(buf, new.reshape(
        (1,) * len(lead) + new.shape), start)
  b, t = new.shape[:2]
  rows = jnp.arange(b)[:, None]
  slots = end[:, None] + jnp.arange(t)[None, :]
  return buf.at[(*lead, rows, slots)].set(new, mode="drop")
