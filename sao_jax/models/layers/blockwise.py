"""Blockwise (flash-style) attention in plain JAX: no [T, S] array, any backend.

Queries are cut into blocks of `block_q` and keys into blocks of `block_kv`
(the last blocks padded; padding never matches any segment). The forward
keeps, per query, the running max, the softmax denominator and the weighted
value sum (online softmax, Milakov & Gimelshein 2018; FlashAttention, Dao et
al. 2022) and stores only the output and the log-sum-exp. The backward
(`jax.custom_vjp`) recomputes each [block_q, block_kv] score block from those
(FlashAttention-2's backward), so neither pass holds more than one score
block. Blocks where no query sees any key (causal future, other segments)
are skipped with `lax.cond`; so are blocks wholly outside a sliding window
(`MaskSpec.window`). Grouped-query attention uses each K/V head for
its G query heads without repeating K/V. Under a layer scan the segment ids
are tied to q (`_tied`) so the scan's linearization cannot hoist the
mask-only block work out of the loop, stacked per block pair (quadratic in
T). docs/design/models.md "Attention" and "The blockwise VJP under a
layer scan".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from sao_jax.models.layers.masks import block_mask
from sao_jax.models.layers.masks import MaskSpec

Array = jax.Array

_MASK_VALUE = -1e30  # Finite: a running max never becomes -inf.
# Segment ids of the padding added to fill the last blocks: never equal to
# each other nor to a real or padding id (-1 - slot, slot < 2**31 - 1).
_Q_FILL = np.iinfo(np.int32).min
_KV_FILL = np.iinfo(np.int32).min + 1


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _pad_to(x: Array, axis: int, size: int, value) -> Array:
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad, constant_values=value)


def _blocks(x: Array, axis: int, block: int) -> Array:
  """Splits `axis` into [n, block] and moves n to the front."""
  shape = x.shape[:axis] + (x.shape[axis] // block, block) + x.shape[axis + 1:]
  return jnp.moveaxis(x.reshape(shape), axis, 0)


def _unblocks(x: Array, axis: int) -> Array:
  """Inverse of `_blocks` (n is axis 0, block at `axis` + 1 after moving)."""
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])


def _tied(anchor: Array, *ids: Array) -> tuple[Array, tuple[Array, ...]]:
  """(anchor, ids) through one optimization barrier (an identity).

  To JAX's partial evaluation the ids then depend on `anchor`: a layer
  scan's linearization hoists out of the loop, stacked per iteration of
  the inner block loops, whatever depends only on loop-invariant inputs
  (the ids), here every block's mask: [nq, nkv, ...] (docs/design/models.md
  "The blockwise VJP under a layer scan").
  """
  return jax.lax.optimization_barrier((anchor, ids))


def _scores(qi: Array, kj: Array, scale: float) -> Array:
  """float32[B, K, G, bq, bkv] scaled scores of one block pair."""
  return jnp.einsum("bqkgd,bskd->bkgqs", qi, kj,
                    preferred_element_type=jnp.float32) * scale


def _forward(q, k, v, q_seg, q_slot, kv_seg, block_q, block_kv, window):
  """Blocked forward. Returns (out [nq,B,bq,K,G,D] f32, lse [nq,B,K,G,bq])."""
  b, _, kh, g, d = q.shape
  scale = 1.0 / float(np.sqrt(d))
  # Not residual-only under a layer scan's linearization (_tied).
  q, (q_seg, q_slot, kv_seg) = _tied(q, q_seg, q_slot, kv_seg)
  kv_slot = jnp.arange(k.shape[1], dtype=jnp.int32)
  kb, vb = _blocks(k, 1, block_kv), _blocks(v, 1, block_kv)
  ksb, kslb = _blocks(kv_seg, 1, block_kv), _blocks(kv_slot, 0, block_kv)

  def q_block(args):
    qi, qs, qsl = args

    def kv_step(carry, kv):
      kj, vj, ks, ksl = kv
      mask = block_mask(qs, qsl, ks, ksl, window)[:, None, None]

      def compute(carry):
        m, l, acc = carry
        s = jnp.where(mask, _scores(qi, kj, scale), _MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(vj.dtype), vj,
                        preferred_element_type=jnp.float32)
        return m_new, alpha * l + p.sum(axis=-1), alpha[..., None] * acc + pv

      return jax.lax.cond(jnp.any(mask), compute, lambda c: c, carry), None

    init = (jnp.full((b, kh, g, block_q), _MASK_VALUE, jnp.float32),
            jnp.zeros((b, kh, g, block_q), jnp.float32),
            jnp.zeros((b, kh, g, block_q, d), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(kv_step, init, (kb, vb, ksb, kslb))
    seen = l > 0  # False only on the padding added to fill a block.
    l_safe = jnp.where(seen, l, 1.0)
    out = jnp.einsum("bkgqd->bqkgd", acc / l_safe[..., None])
    return out, jnp.where(seen, m + jnp.log(l_safe), 0.0)

  return jax.lax.map(q_block, (_blocks(q, 1, block_q), _blocks(q_seg, 1,
                                                               block_q),
                               _blocks(q_slot, 1, block_q)))


def _backward(q, k, v, q_seg, q_slot, kv_seg, out, lse, dout, block_q,
              block_kv, window):
  """Blocked backward (FlashAttention-2): outer kv blocks, inner q blocks."""
  d = q.shape[-1]
  scale = 1.0 / float(np.sqrt(d))
  kv_slot = jnp.arange(k.shape[1], dtype=jnp.int32)
  dout = dout.astype(jnp.float32)
  # D_i = sum_d dO * O, [nq, B, K, G, bq].
  delta = jnp.einsum("nbqkgd,nbqkgd->nbkgq", _blocks(dout, 1, block_q),
                     _blocks(out.astype(jnp.float32), 1, block_q))
  q_args = (_blocks(q, 1, block_q), _blocks(dout, 1, block_q), lse, delta,
            _blocks(q_seg, 1, block_q), _blocks(q_slot, 1, block_q))

  def kv_block(dq, kv):
    kj, vj, ks, ksl = kv

    def q_step(carry, qa):
      qi, doi, lsei, di, qs, qsl = qa
      mask = block_mask(qs, qsl, ks, ksl, window)[:, None, None]

      def compute(_):
        s = _scores(qi, kj, scale)
        p = jnp.where(mask, jnp.exp(s - lsei[..., None]), 0.0)
        dv = jnp.einsum("bkgqs,bqkgd->bskd", p, doi)
        dp = jnp.einsum("bqkgd,bskd->bkgqs", doi, vj.astype(jnp.float32))
        ds = p * (dp - di[..., None]) * scale
        dq_i = jnp.einsum("bkgqs,bskd->bqkgd", ds, kj.astype(jnp.float32))
        dk = jnp.einsum("bkgqs,bqkgd->bskd", ds, qi.astype(jnp.float32))
        return dk, dv, dq_i

      def skip(_):
        return (jnp.zeros(kj.shape, jnp.float32),
                jnp.zeros(vj.shape, jnp.float32),
                jnp.zeros(qi.shape, jnp.float32))

      dk, dv, dq_i = jax.lax.cond(jnp.any(mask), compute, skip, None)
      return (carry[0] + dk, carry[1] + dv), dq_i

    zero = (jnp.zeros(kj.shape, jnp.float32), jnp.zeros(vj.shape, jnp.float32))
    (dk, dv), dq_blocks = jax.lax.scan(q_step, zero, q_args)
    return dq + dq_blocks, (dk, dv)

  dq0 = jnp.zeros((q.shape[1] // block_q, q.shape[0], block_q) + q.shape[2:],
                  jnp.float32)
  dq, (dk, dv) = jax.lax.scan(
      kv_block, dq0, (_blocks(k, 1, block_kv), _blocks(v, 1, block_kv),
                      _blocks(kv_seg, 1, block_kv),
                      _blocks(kv_slot, 0, block_kv)))
  return _unblocks(dq, 1), _unblocks(dk, 1), _unblocks(dv, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _attention(q, k, v, q_seg, q_slot, kv_seg, block_q, block_kv, window):
  out, _ = _forward(q, k, v, q_seg, q_slot, kv_seg, block_q, block_kv, window)
  return _unblocks(out, 1).astype(q.dtype)


def _attention_fwd(q, k, v, q_seg, q_slot, kv_seg, block_q, block_kv, window):
  out, lse = _forward(q, k, v, q_seg, q_slot, kv_seg, block_q, block_kv,
                      window)
  out = _unblocks(out, 1).astype(q.dtype)
  return out, (q, k, v, q_seg, q_slot, kv_seg, window, out, lse)


def _attention_bwd(block_q, block_kv, res, dout):
  q, k, v, q_seg, q_slot, kv_seg, window, out, lse = res
  dq, dk, dv = _backward(q, k, v, q_seg, q_slot, kv_seg, out, lse, dout,
                         block_q, block_kv, window)
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          None, None, None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)


def blockwise_attention(q: Array, k: Array, v: Array, spec: MaskSpec, *,
                        block_q: int, block_kv: int) -> Array:
  """Softmax(q k^T / sqrt(D)) v under `spec`, one score block at a time.

  Args:
    q: [B, T, K, G, D] queries (query head j*G+g uses kv head j).
    k, v: [B, S, K, D] keys and values (slots 0..S-1).
    spec: which keys each query sees (layers/masks.py).
    block_q, block_kv: block sizes (capped at T and S; need not divide them).

  Returns:
    [B, T, K, G, D] in q's dtype.
  """
  t, s = q.shape[1], k.shape[1]
  bq, bkv = min(block_q, t), min(block_kv, s)
  tp, sp = _round_up(t, bq), _round_up(s, bkv)
  out = _attention(
      _pad_to(q, 1, tp, 0), _pad_to(k, 1, sp, 0), _pad_to(v, 1, sp, 0),
      _pad_to(spec.q_segment, 1, tp, _Q_FILL),
      _pad_to(spec.q_slot, 1, tp, 0),
      _pad_to(spec.kv_segment, 1, sp, _KV_FILL), bq, bkv,
      jnp.asarray(spec.window, jnp.int32))
  return out[:, :t]
