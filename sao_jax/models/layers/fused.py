"""The backends' fused attention kernels behind the `MaskSpec` interface.

- `cudnn_attention`: `jax.nn.dot_product_attention` (cuDNN flash attention
  on GPU, bf16/fp16). Its public interface expresses causal attention over a
  prefix of real tokens per row (`is_causal` + sequence lengths), not packed
  segments, so a batch whose rows are not all "one trajectory from slot 0"
  takes the blockwise path instead, chosen at run time with `lax.cond`.
- `splash_attention`: Pallas splash attention on TPU (causal mask and the
  spec's segment ids; padding has unique ids, so it matches the contract
  exactly). GQA: the MQA kernel vmapped over the K/V heads, no K/V repeat.

Both are for self-attention without a KV cache (T == S) and honour a
sliding window (`MaskSpec.window`: cuDNN's `local_window_size`, splash's
`LocalMask`; both count q - k <= window - 1 in slots). docs/design/models.md
"Attention".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.models.layers.blockwise import blockwise_attention
from sao_jax.models.layers.masks import MaskSpec

Array = jax.Array
_SPLASH_FILL = np.iinfo(np.int32).min  # Padding to a block multiple.


def _one_prefix_segment(spec: MaskSpec) -> Array:
  """bool scalar: every row is one segment on slots [0, n) then padding."""
  real = spec.q_segment > 0
  n = jnp.sum(real, axis=1, keepdims=True)
  prefix = real == (jnp.arange(real.shape[1]) < n)
  same = jnp.where(real, spec.q_segment == spec.q_segment[:, :1], True)
  return jnp.all(prefix & same)


def cudnn_attention(q: Array, k: Array, v: Array, spec: MaskSpec, *,
                    block_q: int, block_kv: int,
                    implementation: str = "cudnn") -> Array:
  """`jax.nn.dot_product_attention` under `spec` (falls back, see module doc).

  q: [B, T, K, G, D]; k, v: [B, T, K, D]. `implementation` is 'cudnn' (GPU);
  tests pass 'xla' to check this wrapper's layout and masking on CPU.
  """
  b, t, kh, g, d = q.shape
  lengths = jnp.sum(spec.q_segment > 0, axis=1, dtype=jnp.int32)
  real = (spec.q_segment > 0)[:, :, None, None]

  def fused(q, k, v):
    out = jax.nn.dot_product_attention(
        q.reshape(b, t, kh * g, d), k, v, is_causal=True,
        query_seq_lengths=lengths, key_value_seq_lengths=lengths,
        local_window_size=(spec.window - 1, 0) if spec.window else None,
        implementation=implementation)
    # Padding queries: zero (the contract's value there is never used, and a
    # zero cotangent reaches the kernel).
    return jnp.where(real, out, 0).reshape(q.shape)

  def fallback(q, k, v):
    return blockwise_attention(q, k, v, spec, block_q=block_q,
                               block_kv=block_kv)

  return jax.lax.cond(_one_prefix_segment(spec), fused, fallback, q, k, v)


def splash_attention(q: Array, k: Array, v: Array, spec: MaskSpec, *,
                     block: int, interpret: bool = False) -> Array:
  """Pallas splash attention (TPU) under `spec`; `interpret` runs it on CPU.

  q: [B, T, K, G, D]; k, v: [B, T, K, D]; T is padded to a multiple of
  `block` (a multiple of 128 on TPU).
  """
  # Imported here: the Pallas TPU module is only needed on this path.
  from jax.experimental.pallas.ops.tpu.splash_attention import (  # pylint: disable=g-import-not-at-top
      splash_attention_kernel as splash,
      splash_attention_mask as splash_mask)
  b, t, kh, g, d = q.shape
  tp = -(-t // block) * block
  pad = lambda x, value: jnp.pad(
      x, [(0, 0), (0, tp - t)] + [(0, 0)] * (x.ndim - 2),
      constant_values=value)
  one_mask = (splash_mask.LocalMask((tp, tp), (spec.window - 1, 0), 0)
              if spec.window else splash_mask.CausalMask((tp, tp)))
  mask = splash_mask.MultiHeadMask([one_mask for _ in range(g)])
  sizes = splash.BlockSizes(
      block_q=block, block_kv=block, block_kv_compute=block,
      block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
      block_q_dq=block, block_kv_dq=block)
  kernel = splash.make_splash_mqa_single_device(
      mask, block_sizes=sizes, interpret=interpret)
  scale = 1.0 / float(np.sqrt(d))
  qh = jnp.einsum("btkgd->bkgtd", pad(q * jnp.asarray(scale, q.dtype), 0))
  kt = jnp.einsum("btkd->bktd", pad(k, 0))
  vt = jnp.einsum("btkd->bktd", pad(v, 0))
  # Block padding: an id of its own (padded queries see their own slot only
  # through causal + equal ids with the fill, which never reach real rows).
  seg = pad(spec.q_segment, _SPLASH_FILL)
  kv_seg = pad(spec.kv_segment, _SPLASH_FILL)

  def one(qi, ki, vi, sq, skv):
    return kernel(qi, ki, vi, segment_ids=splash.SegmentIds(q=sq, kv=skv))

  per_head = jax.vmap(one, in_axes=(0, 0, 0, None, None))
  out = jax.vmap(per_head)(qh, kt, vt, seg, kv_seg)  # [B, K, G, Tp, D]
  return jnp.einsum("bkgtd->btkgd", out)[:, :t]
