"""Tests for the attention mask description and the attention paths.

The mask contract (docs/design/models.md "Attention"): a query sees a key iff
both carry the same nonzero segment id and key slot <= query slot; padding
queries see only themselves.
"""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.models import transformer as tm
from sao_jax.models.config import ModelConfig
from sao_jax.models.layers import attention
from sao_jax.models.layers import blockwise
from sao_jax.models.layers import fused as fused_lib
from sao_jax.models.layers import masks

import fresh_process
import tiny_models

CFG = ModelConfig.tiny(vocab_size=61, qkv_bias=True)


def _reference_mask(segment_ids: np.ndarray) -> np.ndarray:
  """bool[B,T,T] written straight from the contract, loop by loop."""
  b, t = segment_ids.shape
  out = np.zeros((b, t, t), bool)
  for i in range(b):
    for q in range(t):
      for k in range(t):
        same = segment_ids[i, q] == segment_ids[i, k] != 0
        out[i, q, k] = (same and k <= q) or (k == q)
  return out


def _packed_batch(rng: np.random.Generator, b: int, t: int):
  """Random rows: left padding, several segments, right padding."""
  seg = np.zeros((b, t), np.int32)
  for i in range(b):
    s = int(rng.integers(0, 3))  # Left pads.
    n = 1
    while s < t - 1:
      length = int(rng.integers(1, max(2, t // 2)))
      seg[i, s:s + length] = n
      s += length + int(rng.integers(0, 2))  # Sometimes a gap of padding.
      n += 1
      if rng.random() < 0.25:
        break
  mask = seg > 0
  positions = np.zeros((b, t), np.int32)
  for i in range(b):
    for n in np.unique(seg[i][seg[i] > 0]):
      idx = np.flatnonzero(seg[i] == n)
      positions[i, idx] = np.arange(idx.size)
  return seg, mask, positions


def test_mask_spec_matches_the_contract():
  rng = np.random.default_rng(0)
  seg, mask, _ = _packed_batch(rng, 6, 17)
  assert (seg.max(axis=1) >= 2).any()  # Several segments in some row.
  spec, valid = masks.mask_spec(jnp.asarray(mask), None, jnp.asarray(seg))
  np.testing.assert_array_equal(masks.dense_mask(spec), _reference_mask(seg))
  np.testing.assert_array_equal(valid, mask)
  # segment_ids=None means attention_mask.astype(int32): one trajectory.
  spec1, _ = masks.mask_spec(jnp.asarray(mask), None)
  np.testing.assert_array_equal(masks.dense_mask(spec1),
                                _reference_mask(mask.astype(np.int32)))


def test_segment_ids_with_a_cache_are_refused():
  cache = tm.init_cache(CFG, 2, 8)
  with pytest.raises(ValueError, match="segment_ids.*cache"):
    masks.mask_spec(jnp.ones((2, 3), bool), cache, jnp.ones((2, 3), jnp.int32))


def test_packed_row_equals_its_segments_run_alone():
  """Policy logits and critic values of a packed row = each segment alone."""
  rng = np.random.default_rng(1)
  t = 14
  seg = np.array([[1] * 5 + [2] * 6 + [3] * 2 + [0]], np.int32)
  tokens = jnp.asarray(rng.integers(1, CFG.vocab_size, (1, t)), jnp.int32)
  mask = jnp.asarray(seg > 0)
  positions = np.zeros((1, t), np.int32)
  for n in (1, 2, 3):
    idx = np.flatnonzero(seg[0] == n)
    positions[0, idx] = np.arange(idx.size)
  model, critic = tm.Transformer(CFG), tm.ValueModel(CFG)
  params = tiny_models.init_params(model, jax.random.key(0), tokens,
                                   positions, mask)
  vparams = {"params": jax.jit(functools.partial(
      tm.value_params_from_policy, config=CFG))(
          params["params"], rng=jax.random.key(1))}
  apply, value = jax.jit(model.apply), jax.jit(critic.apply)
  packed, _ = apply(params, tokens, positions, mask, None, jnp.asarray(seg))
  values = value(vparams, tokens, positions, mask, jnp.asarray(seg))
  for n in (1, 2, 3):
    idx = np.flatnonzero(seg[0] == n)
    sub = tokens[:, idx]
    ones = jnp.ones_like(sub, bool)
    pos = tm.positions_from_mask(ones)
    alone, _ = apply(params, sub, pos, ones)
    np.testing.assert_allclose(packed[0, idx], alone[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(values[0, idx], value(vparams, sub, pos, ones)[0],
                               atol=1e-5, rtol=0)
  # Without segment ids the later segments see the earlier ones: differs.
  unpacked, _ = apply(params, tokens, positions, mask)
  idx2 = np.flatnonzero(seg[0] == 2)
  assert float(jnp.abs(unpacked[0, idx2] - packed[0, idx2]).max()) > 1e-3


def _cfg(attention: str, **kw) -> ModelConfig:
  return ModelConfig.tiny(vocab_size=61, qkv_bias=True, attention=attention,
                          **kw)


@functools.cache
def _loss_and_grads(cfg: ModelConfig):
  """Jitted (params, tokens, positions, mask, seg) -> a masked next-token
  loss of the policy, its logits and its gradients; one compile per cfg."""
  model = tm.Transformer(cfg)

  def loss(p, tokens, positions, mask, seg):
    logits, _ = model.apply(p, tokens, positions, mask, segment_ids=seg)
    logp = jax.nn.log_softmax(logits[:, :-1])
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    w = mask[:, 1:].astype(jnp.float32)
    return jnp.sum(nll * w) / jnp.sum(w), logits

  def value_logits_grads(params, *args):
    (value, logits), grads = jax.value_and_grad(loss, has_aux=True)(
        params, *args)
    return value, logits, grads
  return jax.jit(value_logits_grads)


@functools.cache
def _dense_params(b: int, t: int):
  """The dense policy's params (they depend on the shapes only), once."""
  ones = jnp.ones((b, t), jnp.int32)
  return tiny_models.init_params(tm.Transformer(_cfg("dense")),
                                 jax.random.key(0), ones, ones, ones > 0)


@pytest.mark.parametrize("block_q,block_kv", [(4, 8), (5, 3), (64, 64)])
def test_blockwise_equals_dense_on_loss_logits_and_grads(block_q, block_kv):
  """Random padding, left padding, several segments; blocks not dividing T."""
  rng = np.random.default_rng(block_q * 10 + block_kv)
  b, t = 4, 23
  seg, mask, positions = _packed_batch(rng, b, t)
  seg[0], mask[0] = 0, False  # Row 0: left padding, one trajectory.
  seg[0, 6:], mask[0, 6:] = 1, True
  positions[0] = np.maximum(np.arange(t) - 6, 0)
  tokens = jnp.asarray(rng.integers(1, 61, (b, t)), jnp.int32)
  args = (tokens, jnp.asarray(positions), jnp.asarray(mask), jnp.asarray(seg))
  params = _dense_params(b, t)
  ref = _loss_and_grads(_cfg("dense"))(params, *args)
  got = _loss_and_grads(_cfg("blockwise", attention_block_q=block_q,
                             attention_block_kv=block_kv))(params, *args)
  np.testing.assert_allclose(got[0], ref[0], atol=1e-5, rtol=0)
  np.testing.assert_allclose(got[1], ref[1], atol=1e-5, rtol=0)  # All slots.
  flat_ref, flat_got = jax.tree.leaves(ref[2]), jax.tree.leaves(got[2])
  assert len(flat_ref) == len(flat_got) > 10
  for r, g in zip(flat_ref, flat_got):
    np.testing.assert_allclose(g, r, atol=1e-5, rtol=0)
  assert max(float(jnp.abs(r).max()) for r in flat_ref) > 1e-3


def test_blockwise_value_model_equals_dense():
  rng = np.random.default_rng(7)
  seg, mask, positions = _packed_batch(rng, 3, 19)
  args = (jnp.asarray(rng.integers(1, 61, (3, 19)), jnp.int32),
          jnp.asarray(positions), jnp.asarray(mask))
  params = tiny_models.init_params(tm.ValueModel(_cfg("dense")),
                                   jax.random.key(2), *args)
  def values(cfg):
    return jax.jit(tm.ValueModel(cfg).apply)(params, *args, jnp.asarray(seg))
  np.testing.assert_allclose(
      values(_cfg("blockwise", attention_block_q=4, attention_block_kv=6)),
      values(_cfg("dense")), atol=1e-5, rtol=0)


def test_cached_chunks_through_blockwise_equal_the_dense_full_forward():
  """Sampler prefill/observation chunks (T > 1 with a cache) go blockwise."""
  rng = np.random.default_rng(3)
  b, t = 3, 13
  mask = np.ones((b, t), bool)
  mask[1, :4] = False
  mask[2, 7] = False
  tokens = jnp.asarray(rng.integers(1, 61, (b, t)), jnp.int32)
  mask = jnp.asarray(mask)
  positions = tm.positions_from_mask(mask)
  dense = tm.Transformer(_cfg("dense"))
  params = tiny_models.init_params(dense, jax.random.key(0), tokens,
                                   positions, mask)
  full, _ = jax.jit(dense.apply)(params, tokens, positions, mask)
  cfg = _cfg("blockwise", attention_block_q=2, attention_block_kv=5)
  assert attention.choose(cfg, 5, 16, cached=True) == "blockwise"
  apply = jax.jit(tm.Transformer(cfg).apply)
  cache, outs = tm.init_cache(cfg, b, 16), []
  for lo, hi in [(0, 5), (5, 6), (6, 13)]:
    logits, cache = apply(params, tokens[:, lo:hi], positions[:, lo:hi],
                          mask[:, lo:hi], cache)
    outs.append(logits)
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=1e-5,
                             rtol=0)


def test_choose_per_backend_and_refusals():
  f32, bf16 = _cfg("auto"), _cfg("auto", dtype="bfloat16")
  # CPU: dense while [T, S] is no larger than one block, blockwise beyond.
  assert attention.choose(f32, 512, 512, False, "cpu") == "dense"
  assert attention.choose(f32, 513, 513, False, "cpu") == "blockwise"
  assert attention.choose(f32, 8, 4096, True, "cpu") == "dense"
  assert attention.choose(f32, 512, 4096, True, "cpu") == "blockwise"
  assert attention.choose(f32, 1, 4096, True, "cpu") == "dense"  # Decode.
  assert attention.choose(bf16, 4096, 4096, False, "gpu") == "cudnn"
  assert attention.choose(f32, 4096, 4096, False, "gpu") == "blockwise"
  assert attention.choose(bf16, 64, 4096, True, "gpu") == "blockwise"
  assert attention.choose(f32, 4096, 4096, False, "tpu") == "splash"
  assert attention.choose(f32, 64, 4096, True, "tpu") == "blockwise"
  assert attention.choose(_cfg("dense"), 9999, 9999, False, "tpu") == "dense"
  assert attention.choose(_cfg("blockwise"), 8, 8, False, "cpu") == "blockwise"
  assert attention.choose(_cfg("splash"), 64, 99, True, "tpu") == "blockwise"
  with pytest.raises(ValueError, match="'cudnn' needs a GPU"):
    attention.choose(_cfg("cudnn", dtype="bfloat16"), 8, 8, False, "cpu")
  with pytest.raises(ValueError, match="bf16/fp16"):
    attention.choose(_cfg("cudnn"), 8, 8, False, "gpu")
  with pytest.raises(ValueError, match="'splash' runs on TPU only"):
    attention.choose(_cfg("splash"), 8, 8, False, "gpu")
  with pytest.raises(ValueError, match="attention='flash'"):
    _cfg("flash")
  # The model itself refuses on this (CPU) backend, with the same message.
  tokens = jnp.ones((1, 4), jnp.int32)
  ones = jnp.ones((1, 4), bool)
  with pytest.raises(ValueError, match="'splash' runs on TPU only"):
    tiny_models.init_params(tm.Transformer(_cfg("splash")),
                            jax.random.key(0), tokens,
                            tm.positions_from_mask(ones), ones)


def _qkv(rng, b, t, k=2, g=2, d=8):
  q = jnp.asarray(rng.normal(size=(b, t, k, g, d)), jnp.float32)
  kv = [jnp.asarray(rng.normal(size=(b, t, k, d)), jnp.float32)
        for _ in range(2)]
  return q, *kv


def test_cudnn_wrapper_layout_and_fallback_via_the_xla_implementation():
  """The cuDNN wrapper (GQA layout, lengths, packed-row fallback) on CPU.

  `jax.nn.dot_product_attention(implementation='xla')` stands in for cuDNN;
  the kernel itself needs a GPU.
  """
  rng = np.random.default_rng(4)
  b, t = 3, 11
  lengths = np.array([11, 7, 1])
  prefix = np.arange(t)[None] < lengths[:, None]
  packed = prefix.astype(np.int32)
  packed[0, 5:] = 2  # Two segments in row 0: not expressible, falls back.
  q, k, v = _qkv(rng, b, t)
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
  fused = functools.partial(fused_lib.cudnn_attention, block_q=4,
                            block_kv=4, implementation="xla")

  @jax.jit
  def outputs_and_grads(seg, q, k, v):
    """(fused, dense) outputs on real slots and their (q, k, v) grads."""
    spec, _ = masks.mask_spec(seg > 0, None, seg)
    real = (seg > 0)[:, :, None, None, None]

    def loss(fn, q, k, v):
      return jnp.sum(jnp.where(real, w * fn(q, k, v, spec), 0.0))

    return [(jnp.where(real, fn(q, k, v, spec), 0),
             jax.grad(functools.partial(loss, fn), (0, 1, 2))(q, k, v))
            for fn in (fused, attention.dense_attention)]

  for seg in (prefix.astype(np.int32), packed):  # One compile for both.
    (got, got_grads), (want, want_grads) = outputs_and_grads(
        jnp.asarray(seg), q, k, v)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    for a, r in zip(got_grads, want_grads):
      np.testing.assert_allclose(a, r, atol=1e-5, rtol=0)
  spec, _ = masks.mask_spec(jnp.asarray(packed > 0), None,
                            jnp.asarray(packed))
  assert not bool(fused_lib._one_prefix_segment(spec))  # pylint: disable=protected-access
  spec, _ = masks.mask_spec(jnp.asarray(prefix), None)
  assert bool(fused_lib._one_prefix_segment(spec))  # pylint: disable=protected-access


def _grad_temp_mib(fn, t: int) -> float:
  """Compile-only temp memory (XLA memory_analysis) of d/d(q,k,v) at T=t."""
  mask = jnp.ones((1, t), bool)

  def loss(q, k, v):
    spec, _ = masks.mask_spec(mask, None)
    return jnp.sum(fn(q, k, v, spec) ** 2)

  sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(
      sds(1, t, 2, 4, 32), sds(1, t, 2, 32), sds(1, t, 2, 32)).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 2**20


def test_blockwise_backward_does_not_hold_the_scores():
  """Temp memory grows ~linearly with T; the dense reference quadratically."""
  bw = functools.partial(blockwise.blockwise_attention, block_q=256,
                         block_kv=256)
  small, large = _grad_temp_mib(bw, 1024), _grad_temp_mib(bw, 4096)
  scores_4k = 2 * 4 * 4096 * 4096 * 4 / 2**20  # [K, G, T, S] float32: 512 MiB.
  assert large < scores_4k / 8, (small, large)
  assert large / small < 2.5, (small, large)  # 4x tokens; quadratic: 16x.
  dense_small = _grad_temp_mib(attention.dense_attention, 1024)
  dense_large = _grad_temp_mib(attention.dense_attention, 4096)
  assert dense_large / dense_small > 10  # The check can tell them apart.


@pytest.mark.slow
def test_splash_in_interpret_mode_equals_dense():
  """The splash wrapper (layout, GQA vmap, segment ids, padding to a block)
  run by the Pallas interpreter on CPU, forward and gradients."""
  rng = np.random.default_rng(5)
  b, t = 2, 200  # Not a multiple of the block.
  seg = np.zeros((b, t), np.int32)
  seg[0] = 1
  seg[1, 3:100], seg[1, 100:190] = 1, 2  # Left pad, two segments, right pad.
  spec, _ = masks.mask_spec(jnp.asarray(seg > 0), None, jnp.asarray(seg))
  q, k, v = _qkv(rng, b, t, d=128)
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
  splash = functools.partial(fused_lib.splash_attention, block=128,
                             interpret=True)

  def loss(fn, q, k, v):
    return jnp.sum(w * fn(q, k, v, spec))

  @jax.jit
  def output_and_grads(q, k, v):
    return [(fn(q, k, v, spec),
             jax.grad(functools.partial(loss, fn), (0, 1, 2))(q, k, v))
            for fn in (splash, attention.dense_attention)]

  (out, got), (want, ref) = output_and_grads(q, k, v)
  np.testing.assert_allclose(out, want, atol=1e-5, rtol=0)
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, atol=1e-5, rtol=0)


@pytest.mark.skipif(not fresh_process.libtpu_available()[0],
                    reason="cannot compile for TPUs here: "
                    f"{fresh_process.libtpu_available()[1]}")
def test_model_with_auto_attention_compiles_splash_for_tpu():
  """Ahead-of-time: the policy loss + gradients for a TPU, with 'auto'."""
  fresh_process.run("tpu_checks", "auto_attention_compiles_splash_for_tpu")


def _model_grad_temp_mib(cfg: ModelConfig, t: int) -> float:
  """Compile-only temp memory of the policy's gradient at batch 1 x T=t."""
  model = tm.Transformer(cfg)
  tokens = jax.ShapeDtypeStruct((1, t), jnp.int32)
  mask = jax.ShapeDtypeStruct((1, t), jnp.bool_)
  params = jax.eval_shape(lambda: nn.unbox(model.init(
      jax.random.key(0), jnp.zeros((1, 8), jnp.int32),
      jnp.zeros((1, 8), jnp.int32), jnp.ones((1, 8), bool))))

  def loss(p, tokens, positions, mask, seg):
    logits, _ = model.apply(p, tokens, positions, mask, segment_ids=seg)
    return jnp.sum(jax.nn.log_softmax(logits)[..., 0])

  compiled = jax.jit(jax.grad(loss)).lower(
      params, tokens, tokens, mask, tokens).compile()
  return compiled.memory_analysis().temp_size_in_bytes / 2**20


@pytest.mark.parametrize("remat_policy", ["none", "full"])
def test_scanned_layers_gradient_memory_is_linear_in_tokens(remat_policy):
  """Under `nn.scan` the layer scan's linearization hoists work that needs
  only loop-invariant inputs (the segment ids) out of the loop; the
  blockwise forward's per-block masks must not be among it (stacked over
  every block pair: quadratic). blockwise._forward ties the ids to q."""
  cfg = _cfg("blockwise", attention_block_q=256, attention_block_kv=256,
             scan_layers=True, remat_policy=remat_policy)
  small, large = (_model_grad_temp_mib(cfg, 1024),
                  _model_grad_temp_mib(cfg, 4096))
  # 4x tokens. Hoisted, the stacks are [nq, nkv, B, K, G, bq, bkv]: 16x
  # (before the tie: 57 -> 707 MiB with 'full', 68 -> 749 MiB with 'none').
  assert large / small < 5, (small, large)
  unrolled = dataclasses.replace(cfg, scan_layers=False)
  assert large < 1.5 * _model_grad_temp_mib(unrolled, 4096), large
