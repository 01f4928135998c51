"""Tests for sao_jax.sampler.{sampling,generate} and sao_jax.models.logprobs."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.models.config import ModelConfig
from sao_jax.models.logprobs import token_logprobs
from sao_jax.models.transformer import positions_from_mask
from sao_jax.models.transformer import Transformer
from sao_jax.sampler import generate as gen_lib
from sao_jax.sampler import sampling

_CFG = ModelConfig.tiny(vocab_size=96)


def _params(seed: int, scale: float = 8.0):
  """Random params, scaled so next-token distributions are far from uniform."""
  x = jnp.zeros((1, 4), jnp.int32)
  init = jax.jit(lambda k: Transformer(_CFG).init(k, x, x, x > -1)["params"])
  params = nn.unbox(init(jax.random.PRNGKey(seed)))
  return jax.tree.map(lambda a: a * scale if a.ndim > 1 else a, params)


@pytest.fixture(scope="module")
def params():
  return _params(0)


def _prompts(rng: np.random.Generator, lengths):
  return [list(rng.integers(4, _CFG.vocab_size, size=n)) for n in lengths]


def _check_logprobs(params, histories, action_masks, logps, temperature):
  """Full-forward log-probs of right-padded histories vs recorded ones."""
  t = max(len(h) for h in histories)
  toks = np.zeros((len(histories), t), np.int32)
  mask = np.zeros((len(histories), t), bool)
  for i, h in enumerate(histories):
    toks[i, :len(h)], mask[i, :len(h)] = h, True
  ref = np.asarray(token_logprobs(params, _CFG, jnp.asarray(toks),
                                  jnp.asarray(mask), temperature))
  n_checked = 0
  for i, h in enumerate(histories):
    am = np.asarray(action_masks[i], bool)
    got = np.asarray(logps[i])[am]
    want = ref[i, :len(h)][am]
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    n_checked += am.sum()
  return n_checked


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_full_forward_single_turn(params, temperature):
  rng = np.random.default_rng(1)
  prompts = _prompts(rng, [3, 9, 5, 1])
  segs = gen_lib.generate(
      params, _CFG, prompts, jax.random.PRNGKey(7), max_new_tokens=12,
      sampling=sampling.SamplingParams(temperature=temperature))
  histories, masks, logps = [], [], []
  for p, s in zip(prompts, segs):
    assert len(s.tokens) == 12 and not s.stopped
    histories.append(p + list(s.tokens))
    masks.append([0] * len(p) + [1] * len(s.tokens))
    logps.append(np.concatenate([np.zeros(len(p)), s.logprobs]))
  assert _check_logprobs(params, histories, masks, logps, temperature) == 48
  # The check is not vacuous: distributions are far from uniform.
  all_lp = np.concatenate([s.logprobs for s in segs])
  assert all_lp.std() > 0.3 and all_lp.max() > -np.log(_CFG.vocab_size) + 1


@pytest.mark.slow
def test_logprobs_match_full_forward_multi_turn_with_weight_swap(params):
  rng = np.random.default_rng(2)
  b = 3
  stop = [[5, 6], [7], [5, 8, 9]]  # Several stop tokens, per row.
  # Each row holds only its own tokens (per-row cache ends), so 96 slots
  # hold the whole episode.
  g = gen_lib.Generator(_CFG, params, b, max_len=96,
                        sampling=sampling.SamplingParams(temperature=0.7),
                        rng=jax.random.PRNGKey(3))
  prompts = _prompts(rng, [4, 11, 2])
  g.append(prompts)
  masks = [[0] * len(p) for p in prompts]
  logps = [[0.0] * len(p) for p in prompts]
  cur_params = params
  for turn in range(4):
    if turn == 2:
      cur_params = _params(5)  # New policy version between turns.
      g.set_params(cur_params)
    segs = g.generate(stop, [6, 9, 4])
    for i, s in enumerate(segs):
      masks[i] += [1] * len(s.tokens)
      logps[i] += list(s.logprobs)
      if s.stopped:
        assert int(s.tokens[-1]) in stop[i]
        assert not set(int(t) for t in s.tokens[:-1]) & set(stop[i])
      else:
        assert len(s.tokens) == [6, 9, 4][i]
    obs = _prompts(rng, [3, 0, 6])  # Row 1 gets no observation this turn.
    g.append(obs)
    for i, o in enumerate(obs):
      masks[i] += [0] * len(o)
      logps[i] += [0.0] * len(o)
    if turn == 1:
      # Pre-swap tokens are scored under the old weights.
      assert _check_logprobs(params, g.histories, masks, logps, 0.7) > 0
      pre = [list(m) for m in masks]
  hist = g.histories
  post = [np.asarray(m) * (np.arange(len(m)) >= len(p0))
          for m, p0 in zip(masks, pre)]
  assert _check_logprobs(cur_params, hist, post, logps, 0.7) > 0
  assert all(len(h) == len(m) for h, m in zip(hist, masks))


def test_greedy_equals_stepwise_argmax(params):
  rng = np.random.default_rng(3)
  prompts = _prompts(rng, [6, 2, 12, 3])
  segs = gen_lib.generate(params, _CFG, prompts, jax.random.PRNGKey(0),
                          max_new_tokens=10,
                          sampling=sampling.SamplingParams(greedy=True))

  @jax.jit
  def next_token(x, n):  # Full forward (no cache) over right-padded x[:n].
    m = jnp.arange(x.shape[1])[None] < n
    logits, _ = Transformer(_CFG).apply(
        {"params": params}, x, positions_from_mask(m), m)
    return jnp.argmax(logits[0, n - 1])

  for p, s in zip(prompts, segs):
    seq = np.zeros((1, 32), np.int32)
    seq[0, :len(p)] = p
    for n in range(len(p), len(p) + 10):
      seq[0, n] = int(next_token(jnp.asarray(seq), n))
    assert list(s.tokens) == list(seq[0, len(p):len(p) + 10])


def test_sampling_is_reproducible(params):
  prompts = _prompts(np.random.default_rng(4), [5, 7, 10, 1])
  run = lambda k: gen_lib.generate(params, _CFG, prompts, jax.random.PRNGKey(k),
                                   max_new_tokens=12)
  a, b, c = run(1), run(1), run(2)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x.tokens, y.tokens)
    np.testing.assert_array_equal(x.logprobs, y.logprobs)
  assert any(not np.array_equal(x.tokens, z.tokens) for x, z in zip(a, c))


@pytest.mark.parametrize("row_subsets,prefill_rows", [
    (True, 0), (False, 0), (True, 2)])
def test_rows_fed_alone_match_full_forward_and_keep_the_others(
    params, row_subsets, prefill_rows):
  """Appending to or decoding some rows runs only those rows (`append_rows`,
  `decode_rows`), or the whole batch masked (``row_subsets=False``), or
  ``prefill_rows`` rows a call (the five prompts in three calls, a rebuild
  after new weights too); every row's log-probs still equal the full
  forward of its own history, a refilled row holds only its new episode,
  and the rows not fed are left unchanged."""
  rng = np.random.default_rng(8)
  g = gen_lib.Generator(_CFG, params, 5, max_len=64,
                        sampling=sampling.SamplingParams(temperature=0.7),
                        rng=jax.random.PRNGKey(9), row_subsets=row_subsets,
                        prefill_rows=prefill_rows)
  prompts = _prompts(rng, [4, 9, 2, 6, 5])
  g.append(prompts)
  masks = [[0] * len(p) for p in prompts]
  logps = [[0.0] * len(p) for p in prompts]

  def act(budgets, active=None):
    for i, s in enumerate(g.generate([], budgets, active)):
      masks[i] += [1] * len(s.tokens)
      logps[i] += list(s.logprobs)

  act([5, 3, 6, 4, 2])
  if prefill_rows:  # The same weights, the cache rebuilt from the histories.
    g.set_params(params)
  before = g.histories
  obs = _prompts(rng, [0, 0, 7, 0, 0])  # One row of five: the gather path.
  g.append(obs)
  masks[2] += [0] * 7
  logps[2] += [0.0] * 7
  assert g.histories[:2] + g.histories[3:] == before[:2] + before[3:]
  act(5, [False, False, True, False, False])  # Row 2 decodes alone.
  assert g.last_steps == 5
  assert g.histories[:2] + g.histories[3:] == before[:2] + before[3:]
  g.reset_rows([4])  # A refill: row 4 gets a new episode.
  fresh = _prompts(rng, [0, 0, 0, 0, 3])
  g.append(fresh)
  masks[4], logps[4] = [0] * 3, [0.0] * 3
  assert g.histories[4] == fresh[4]
  act([4, 4, 4, 4, 4])
  # 5+3+6+4 before the refill, 5 by row 2 alone, 4 per row after it.
  assert _check_logprobs(params, g.histories, masks, logps, 0.7) == 43


def test_stops_early_when_all_rows_done(params):
  prompts = _prompts(np.random.default_rng(5), [3, 3, 10, 6])
  greedy = sampling.SamplingParams(greedy=True)
  ref = gen_lib.generate(params, _CFG, prompts, jax.random.PRNGKey(0),
                         max_new_tokens=10, sampling=greedy)
  # Stop each row on its own 3rd greedy token.
  stops = [[int(s.tokens[2])] for s in ref]
  g = gen_lib.Generator(_CFG, params, 4, max_len=32, sampling=greedy)
  g.append(prompts)
  segs = g.generate(stops, 16)
  first = [list(s.tokens).index(st[0]) + 1 for s, st in zip(ref, stops)]
  assert [len(s.tokens) for s in segs] == first
  assert all(s.stopped for s in segs)
  assert g.last_steps == max(first)  # The loop ran only until all stopped.


def test_truncate_logits_matches_numpy():
  rng = np.random.default_rng(6)
  logits = rng.normal(size=(4, 20)).astype(np.float32) * 2
  out = np.asarray(sampling.truncate_logits(jnp.asarray(logits), top_p=0.6,
                                            top_k=5))
  for row, got in zip(logits, out):
    order = np.argsort(-row)
    p = np.exp(row - row.max())
    p /= p.sum()
    cum_before = np.cumsum(p[order]) - p[order]
    nucleus = set(order[cum_before < 0.6])
    keep = nucleus & set(order[:5])
    assert set(np.flatnonzero(np.isfinite(got))) == keep
    np.testing.assert_array_equal(got[list(keep)], row[list(keep)])


def test_sample_frequencies_and_truncated_logprob():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.1, 0.06, 0.04]] * 20000))
  params = sampling.SamplingParams(top_p=0.85, truncated_logprobs=True)
  toks, lps = sampling.sample(jax.random.PRNGKey(0), logits, params)
  freq = np.bincount(np.asarray(toks), minlength=5) / 20000
  want = np.array([0.5, 0.3, 0.1, 0, 0]) / 0.9
  np.testing.assert_allclose(freq, want, atol=0.015)
  np.testing.assert_allclose(np.asarray(lps), np.log(want[np.asarray(toks)]),
                             atol=1e-5)
  full = sampling.SamplingParams(top_p=0.85)
  _, lps_full = sampling.sample(jax.random.PRNGKey(0), logits, full)
  np.testing.assert_allclose(
      np.asarray(lps_full), np.log(np.array([0.5, 0.3, 0.1, .06, .04]))[
          np.asarray(toks)], atol=1e-5)


def test_rejects_bad_sampling_params():
  with pytest.raises(ValueError, match="temperature"):
    sampling.SamplingParams(temperature=0.0)
  with pytest.raises(ValueError, match="top_p"):
    sampling.SamplingParams(top_p=0.0)


def test_cache_too_small_raises(params):
  g = gen_lib.Generator(_CFG, params, 1, max_len=16)
  g.append([[5] * 12])
  with pytest.raises(ValueError, match="raise max_len"):
    g.generate([], 16)
