"""Tests for the attention mask description and the attention paths.

The mask contract (docs/DESIGN.md §5, "Attention"): a query sees a key iff
both carry the same nonzero segment id and key slot <= query slot; padding
queries see only themselves.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.models import transformer as tm
from sao_jax.models.config import ModelConfig
from sao_jax.models.layers import masks

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
  params = nn.unbox(model.init(jax.random.key(0), tokens, positions, mask))
  vparams = {"params": tm.value_params_from_policy(
      params["params"], CFG, jax.random.key(1))}
  packed, _ = model.apply(params, tokens, positions, mask,
                          segment_ids=jnp.asarray(seg))
  values = critic.apply(vparams, tokens, positions, mask, jnp.asarray(seg))
  for n in (1, 2, 3):
    idx = np.flatnonzero(seg[0] == n)
    sub = tokens[:, idx]
    ones = jnp.ones_like(sub, bool)
    pos = tm.positions_from_mask(ones)
    alone, _ = model.apply(params, sub, pos, ones)
    np.testing.assert_allclose(packed[0, idx], alone[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(values[0, idx],
                               critic.apply(vparams, sub, pos, ones)[0],
                               atol=1e-5, rtol=0)
  # Without segment ids the later segments see the earlier ones: differs.
  unpacked, _ = model.apply(params, tokens, positions, mask)
  idx2 = np.flatnonzero(seg[0] == 2)
  assert float(jnp.abs(unpacked[0, idx2] - packed[0, idx2]).max()) > 1e-3
