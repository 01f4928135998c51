"""Sliding-window attention (`MaskSpec.window`) in every attention path.

The rule (layers/masks.py): query slot q sees key slot s of its segment iff
s <= q and q - s < window (transformers' `sliding_window_overlay`).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.models.config import ModelConfig
from sao_jax.models.layers import attention
from sao_jax.models.layers import blockwise
from sao_jax.models.layers import fused as fused_lib
from sao_jax.models.layers import masks

WINDOW = 3


def _spec(seg: np.ndarray, window: int = WINDOW) -> masks.MaskSpec:
  spec, _ = masks.mask_spec(jnp.asarray(seg > 0), None, jnp.asarray(seg))
  return spec.replace(window=window)


def _rows() -> np.ndarray:
  seg = np.zeros((3, 13), np.int32)
  seg[0] = 1
  seg[1, 4:] = 1  # Left padding.
  seg[2, 1:6], seg[2, 6:12] = 1, 2  # Packed, right padding.
  return seg


def _qkv(rng, b, t, k=2, g=2, d=8):
  q = jnp.asarray(rng.normal(size=(b, t, k, g, d)), jnp.float32)
  kv = [jnp.asarray(rng.normal(size=(b, t, k, d)), jnp.float32)
        for _ in range(2)]
  return q, *kv


def test_dense_mask_is_the_rule_written_loop_by_loop():
  seg = _rows()
  got = np.asarray(masks.dense_mask(_spec(seg)))
  b, t = seg.shape
  for i in range(b):
    for q in range(t):
      for s in range(t):
        same = seg[i, q] == seg[i, s] != 0
        want = (same and 0 <= q - s < WINDOW) or s == q
        assert got[i, q, s] == want, (i, q, s)
  assert got.sum() < np.asarray(masks.dense_mask(_spec(seg, 0))).sum()


@pytest.mark.parametrize("block", [2, 4, 16])
def test_blockwise_equals_dense_with_a_window(block):
  """Forward and gradients; with block 2 whole blocks lie outside the window
  (skipped by lax.cond) and the result is still exact."""
  rng = np.random.default_rng(0)
  seg = _rows()
  spec = _spec(seg)
  q, k, v = _qkv(rng, *seg.shape)
  w = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
  bw = functools.partial(blockwise.blockwise_attention, block_q=block,
                         block_kv=block)
  np.testing.assert_allclose(bw(q, k, v, spec),
                             attention.dense_attention(q, k, v, spec),
                             atol=1e-5, rtol=0)
  loss = lambda fn, *a: jnp.sum(w * fn(*a, spec))
  for a, r in zip(jax.grad(functools.partial(loss, bw), (0, 1, 2))(q, k, v),
                  jax.grad(functools.partial(loss, attention.dense_attention),
                           (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(a, r, atol=1e-5, rtol=0)
  full = attention.dense_attention(q, k, v, spec.replace(window=0))
  assert np.abs(np.asarray(full - bw(q, k, v, spec))).max() > 1e-2


def test_cudnn_wrapper_honours_the_window_via_the_xla_implementation():
  rng = np.random.default_rng(1)
  seg = (np.arange(13)[None] < np.array([[13], [9], [2]])).astype(np.int32)
  spec = _spec(seg)
  real = jnp.asarray(seg > 0)[:, :, None, None, None]
  q, k, v = _qkv(rng, *seg.shape)
  fused = fused_lib.cudnn_attention(q, k, v, spec, block_q=4, block_kv=4,
                                    implementation="xla")
  np.testing.assert_allclose(
      jnp.where(real, fused, 0),
      jnp.where(real, attention.dense_attention(q, k, v, spec), 0),
      atol=1e-5, rtol=0)


@pytest.mark.slow
def test_splash_in_interpret_mode_honours_the_window():
  rng = np.random.default_rng(2)
  seg = np.zeros((2, 200), np.int32)
  seg[0] = 1
  seg[1, 3:100], seg[1, 100:190] = 1, 2
  spec = _spec(seg, window=37)
  q, k, v = _qkv(rng, *seg.shape, d=128)
  got = fused_lib.splash_attention(q, k, v, spec, block=128, interpret=True)
  np.testing.assert_allclose(got, attention.dense_attention(q, k, v, spec),
                             atol=1e-5, rtol=0)


def test_config_validates_the_window():
  with pytest.raises(ValueError, match="sliding_window"):
    ModelConfig.tiny(sliding_window=-1)
  cfg = ModelConfig.tiny(sliding_window=4)
  assert cfg.hf_architecture() == "MistralForCausalLM"
  assert not cfg.same_architecture(ModelConfig.tiny())


def test_mixed_layer_types_under_scan_avoid_the_fused_kernels():
  types = ("sliding_attention", "full_attention")
  cfg = ModelConfig.tiny(sliding_window=4, layer_types=types,
                         dtype="bfloat16")
  assert attention.choose(cfg, 64, 64, False, backend="gpu") == "blockwise"
  assert attention.choose(cfg, 1024, 1024, False, backend="tpu") == (
      "blockwise")
  unrolled = ModelConfig.tiny(sliding_window=4, layer_types=types,
                              dtype="bfloat16", scan_layers=False)
  assert attention.choose(unrolled, 64, 64, False, backend="gpu") == "cudnn"
  for name in ("cudnn", "splash"):
    backend = "gpu" if name == "cudnn" else "tpu"
    with pytest.raises(ValueError, match="layer_types"):
      attention.choose(ModelConfig.tiny(
          sliding_window=4, layer_types=types, dtype="bfloat16",
          attention=name), 64, 64, False, backend=backend)


def test_traced_window_equals_the_static_one():
  """A scanned layer's window is a traced scalar; 0 means no window."""
  rng = np.random.default_rng(3)
  seg = _rows()
  q, k, v = _qkv(rng, *seg.shape)
  for w in (WINDOW, 0):
    static = attention.dense_attention(q, k, v, _spec(seg, w))
    traced = jax.jit(lambda w, q=q, k=k, v=v: attention.dense_attention(
        q, k, v, _spec(seg).replace(window=w)))(jnp.int32(w))
    np.testing.assert_allclose(traced, static, atol=1e-6, rtol=0)
    bw = jax.jit(lambda w, q=q, k=k, v=v: blockwise.blockwise_attention(
        q, k, v, _spec(seg).replace(window=w), block_q=4, block_kv=4))(
            jnp.int32(w))
    np.testing.assert_allclose(bw, static, atol=1e-5, rtol=0)
