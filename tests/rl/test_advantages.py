"""Tests for the advantage estimators (the critic's in sao_jax.rl.losses, the
others in sao_jax.rl.advantages) against independent NumPy references."""

import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.rl import advantages as adv_lib
from sao_jax.rl import losses


# ----------------------------------------------------------------------------
# NumPy references.
# ----------------------------------------------------------------------------


def np_skip_gae(rewards, values, mask, gamma, lam):
  """Skip-observation GAE (SAO Eqs. 4–5) by explicit next-action search."""
  rewards = np.asarray(rewards, np.float64)
  values = np.asarray(values, np.float64)
  b, t = rewards.shape
  gamma = np.broadcast_to(np.asarray(gamma, np.float64), (b,))
  lam = np.broadcast_to(np.asarray(lam, np.float64), (b,))
  adv = np.zeros((b, t))
  for i in range(b):
    actions = [j for j in range(t) if mask[i, j]]
    for pos in reversed(range(len(actions))):
      j = actions[pos]
      nxt = actions[pos + 1] if pos + 1 < len(actions) else t
      # Rewards on non-action tokens after j (up to the next action) go to j.
      r = rewards[i, j] + rewards[i, j + 1:nxt].sum()
      v_next = values[i, nxt] if nxt < t else 0.0
      a_next = adv[i, nxt] if nxt < t else 0.0
      delta = r + gamma[i] * v_next - values[i, j]
      adv[i, j] = delta + gamma[i] * lam[i] * a_next
  ret = np.where(mask > 0, adv + values, 0.0)
  return adv, ret


def np_textbook_gae(rewards, values, gamma, lam):
  """Â_t = Σ_l (γλ)^l δ_{t+l} with δ_t = r_t + γV_{t+1} − V_t, V_T = 0 (1-D)."""
  t = len(rewards)
  v_ext = np.append(values, 0.0)
  delta = rewards + gamma * v_ext[1:] - v_ext[:-1]
  return np.array([sum((gamma * lam) ** l * delta[s + l] for l in range(t - s))
                   for s in range(t)])


def random_case(rng, b, t, p_action=0.6):
  rewards = rng.normal(size=(b, t)).astype(np.float32)
  values = rng.normal(size=(b, t)).astype(np.float32)
  mask = (rng.random((b, t)) < p_action).astype(np.float32)
  return rewards, values, mask


gae_jit = jax.jit(losses.gae)


# ----------------------------------------------------------------------------
# GAE.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_gae_matches_numpy_reverse_loop_with_gaps(seed):
  rng = np.random.default_rng(seed)
  rewards, values, mask = random_case(rng, 5, 13)
  mask[0] = 0  # An empty row.
  gamma = 0.97
  lam = rng.uniform(0.0, 1.0, size=5).astype(np.float32)  # Per-row λ.
  a, r = gae_jit(rewards, values, mask, gamma=gamma, lam=lam)
  ref_a, ref_r = np_skip_gae(rewards, values, mask, gamma, lam)
  np.testing.assert_allclose(np.asarray(a), ref_a, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(r), ref_r, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(a)[mask == 0] == 0.0)
  assert np.all(np.asarray(r)[mask == 0] == 0.0)


def test_gae_all_action_mask_is_textbook_gae():
  rng = np.random.default_rng(7)
  rewards, values, _ = random_case(rng, 3, 9)
  mask = np.ones((3, 9), np.float32)
  for gamma, lam in ((0.99, 0.95), (1.0, 0.5), (0.9, 0.0)):
    a, r = gae_jit(rewards, values, mask, gamma=gamma, lam=lam)
    for i in range(3):
      ref = np_textbook_gae(rewards[i].astype(np.float64),
                            values[i].astype(np.float64), gamma, lam)
      np.testing.assert_allclose(np.asarray(a)[i], ref, rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(np.asarray(r)[i], ref + values[i], rtol=1e-5,
                                 atol=1e-5)


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    mask_bits=st.lists(st.lists(st.booleans(), min_size=10, max_size=10),
                       min_size=3, max_size=3),
    seed=st.integers(0, 2**31 - 1),
    gamma=st.floats(0.5, 1.0),
    lams=st.lists(st.floats(0.0, 1.0), min_size=3, max_size=3))
def test_skip_observation_gae_equals_gae_on_compacted_actions(
    mask_bits, seed, gamma, lams):
  rng = np.random.default_rng(seed)
  mask = np.array(mask_bits, np.float32)
  values = rng.normal(size=(3, 10)).astype(np.float32)
  rewards = (rng.normal(size=(3, 10)) * mask).astype(np.float32)
  a, r = gae_jit(rewards, values, mask, gamma=gamma,
                 lam=np.array(lams, np.float32))
  for i in range(3):
    on = mask[i] > 0
    if not on.any():
      assert np.all(np.asarray(a)[i] == 0.0)
      continue
    # Ordinary GAE on the action-only compacted row, via the same jitted op.
    ca, cr = gae_jit(rewards[i][on][None], values[i][on][None],
                     np.ones((1, int(on.sum())), np.float32), gamma=gamma,
                     lam=lams[i])
    np.testing.assert_allclose(np.asarray(a)[i][on], np.asarray(ca)[0],
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(r)[i][on], np.asarray(cr)[0],
                               rtol=1e-5, atol=1e-5)
    # And that compacted GAE is the textbook one.
    ref = np_textbook_gae(rewards[i][on].astype(np.float64),
                          values[i][on].astype(np.float64), gamma, lams[i])
    np.testing.assert_allclose(np.asarray(ca)[0], ref, rtol=1e-4, atol=1e-4)


def test_lambda_one_gamma_one_returns_are_reward_to_go():
  rng = np.random.default_rng(3)
  rewards, values, mask = random_case(rng, 4, 11)
  a, r = gae_jit(rewards, values, mask, gamma=1.0, lam=1.0)
  for i in range(4):
    for j in range(11):
      if mask[i, j]:
        # Every reward at or after j counts (observation rewards included).
        np.testing.assert_allclose(float(r[i, j]), rewards[i, j:].sum(),
                                   rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(float(a[i, j]),
                                   rewards[i, j:].sum() - values[i, j],
                                   rtol=1e-5, atol=1e-5)
  # With λ = 1 the returns do not depend on V: reward_to_go is GAE with V = 0.
  rtg = adv_lib.reward_to_go(rewards, mask)
  np.testing.assert_allclose(np.asarray(rtg), np.asarray(r), rtol=1e-5,
                             atol=1e-5)


def test_observation_rewards_go_to_preceding_action_prompt_rewards_dropped():
  # Tokens:   prompt a    a    obs  obs  a    obs
  mask = np.array([[0, 1, 1, 0, 0, 1, 0]], np.float32)
  rewards = np.array([[5.0, 0.0, 1.0, 2.0, 0.5, 0.0, 3.0]], np.float32)
  values = np.zeros_like(rewards)
  a, r = losses.gae(rewards, values, mask, gamma=1.0, lam=1.0)
  # Effective rewards: t1: 0, t2: 1+2+0.5, t5: 0+3; prompt reward 5 dropped.
  np.testing.assert_allclose(np.asarray(r), [[0, 6.5, 6.5, 0, 0, 3.0, 0]])
  np.testing.assert_allclose(np.asarray(a), np.asarray(r))
  # With γ = 0.5 the gap costs no discount: one step per action-token hop.
  a, r = losses.gae(rewards, values, mask, gamma=0.5, lam=1.0)
  np.testing.assert_allclose(np.asarray(r)[0, [1, 2, 5]],
                             [0.5 * (3.5 + 0.5 * 3.0), 3.5 + 0.5 * 3.0, 3.0])


def test_gae_per_row_lambda_matches_separate_calls():
  rng = np.random.default_rng(4)
  rewards, values, mask = random_case(rng, 3, 8)
  lam = np.array([0.0, 0.5, 1.0], np.float32)
  a, _ = gae_jit(rewards, values, mask, gamma=0.9, lam=lam)
  for i in range(3):
    ai, _ = gae_jit(rewards[i:i + 1], values[i:i + 1], mask[i:i + 1], gamma=0.9,
                    lam=float(lam[i]))
    np.testing.assert_allclose(np.asarray(a)[i], np.asarray(ai)[0], rtol=1e-6)


def test_gae_lambda_zero_is_one_step_td():
  rng = np.random.default_rng(5)
  rewards, values, _ = random_case(rng, 1, 6)
  mask = np.array([[1, 1, 0, 1, 0, 1]], np.float32)
  a, _ = losses.gae(rewards, values, mask, gamma=0.8, lam=0.0)
  r, v = rewards[0], values[0]
  expected = [r[0] + 0.8 * v[1] - v[0], r[1] + r[2] + 0.8 * v[3] - v[1], 0.0,
              r[3] + r[4] + 0.8 * v[5] - v[3], 0.0, r[5] - v[5]]
  np.testing.assert_allclose(np.asarray(a)[0], expected, rtol=1e-5, atol=1e-6)


def test_gae_masked_values_never_leak_and_empty_rows_are_zero():
  rng = np.random.default_rng(6)
  rewards, values, mask = random_case(rng, 3, 7)
  mask[2] = 0
  junk = np.where(mask > 0, values, np.nan).astype(np.float32)
  a1, r1 = gae_jit(rewards, values, mask, gamma=0.95, lam=0.9)
  a2, r2 = gae_jit(rewards, junk, mask, gamma=0.95, lam=0.9)
  np.testing.assert_array_equal(np.asarray(a1), np.asarray(a2))
  np.testing.assert_array_equal(np.asarray(r1), np.asarray(r2))
  assert np.all(np.asarray(a2)[2] == 0.0) and np.all(np.asarray(r2)[2] == 0.0)
  # Gradient w.r.t. values is finite and zero on non-action tokens.
  g = jax.grad(lambda v: jnp.sum(losses.gae(rewards, v, mask, gamma=0.95,
                                             lam=0.9)[0]))(jnp.asarray(junk))
  assert np.all(np.isfinite(np.asarray(g)))
  assert np.all(np.asarray(g)[mask == 0] == 0.0)


# ----------------------------------------------------------------------------
# Length-adaptive λ and decoupled GAE.
# ----------------------------------------------------------------------------


def test_length_adaptive_lambda_values():
  lam = losses.length_adaptive_lambda(jnp.array([0, 1, 2, 100, 1000]),
                                       alpha=1.5)
  np.testing.assert_allclose(np.asarray(lam),
                             [0.0, 1 - 1 / 1.5, 1 - 1 / 3.0, 1 - 1 / 150,
                              1 - 1 / 1500], rtol=1e-6)
  # VAPO α=0.05: 1 − 1/(0.05·10) = −1 → clipped to 0; l=200 → 0.9.
  lam = losses.length_adaptive_lambda(jnp.array([10, 20, 200]), alpha=0.05)
  np.testing.assert_allclose(np.asarray(lam), [0.0, 0.0, 0.9], rtol=1e-6,
                             atol=1e-7)
  g = jax.grad(lambda l: losses.length_adaptive_lambda(l).sum())(
      jnp.array([0.0, 3.0]))
  assert np.all(np.isfinite(np.asarray(g)))


def test_decoupled_gae_policy_and_critic_lambdas():
  rng = np.random.default_rng(8)
  rewards, values, mask = random_case(rng, 4, 12)
  mask[3] = 0
  pa, vt = jax.jit(losses.decoupled_gae)(rewards, values, mask)
  n = mask.sum(1)
  lam_p = np.where(n > 0, np.clip(1 - 1 / (1.5 * np.maximum(n, 1)), 0, 1), 0)
  ref_a, _ = np_skip_gae(rewards, values, mask, 1.0, lam_p)
  _, ref_r = np_skip_gae(rewards, values, mask, 1.0, 1.0)
  np.testing.assert_allclose(np.asarray(pa), ref_a, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(vt), ref_r, rtol=1e-5, atol=1e-5)
  pa_vapo, _ = losses.decoupled_gae(rewards, values, mask,
                                     alpha=losses.VAPO_ALPHA)
  lam_v = np.where(n > 0, np.clip(1 - 1 / (0.05 * np.maximum(n, 1)), 0, 1), 0)
  np.testing.assert_allclose(np.asarray(pa_vapo),
                             np_skip_gae(rewards, values, mask, 1.0, lam_v)[0],
                             rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------
# Group and batch baselines.
# ----------------------------------------------------------------------------


def test_group_zscore_mean_rloo_against_numpy():
  rng = np.random.default_rng(9)
  r = rng.normal(size=(4, 5)).astype(np.float32)
  r[2] = 1.0  # All equal -> 0.
  z = adv_lib.group_zscore(r)
  ref = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) +
                                          1e-6)
  np.testing.assert_allclose(np.asarray(z), ref, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(z)[2] == 0.0)
  np.testing.assert_allclose(np.asarray(adv_lib.group_mean(r)),
                             r - r.mean(1, keepdims=True), rtol=1e-5, atol=1e-6)
  loo = np.array([[r[g, i] - np.delete(r[g], i).mean() for i in range(5)]
                  for g in range(4)])
  np.testing.assert_allclose(np.asarray(adv_lib.rloo(r)), loo, rtol=1e-5,
                             atol=1e-5)


def test_group_estimators_with_ragged_group_ids():
  r = np.array([1.0, 0.0, 3.0, 2.0, 5.0, 4.0], np.float32)
  ids = np.array([0, 1, 0, 1, 2, 0])
  # Group 0: {1, 3, 4} mean 8/3; group 1: {0, 2} mean 1; group 2: {5} singleton.
  gm = adv_lib.group_mean(r, ids, 3)
  np.testing.assert_allclose(np.asarray(gm),
                             [1 - 8 / 3, -1, 3 - 8 / 3, 1, 0, 4 - 8 / 3],
                             rtol=1e-5)
  z = adv_lib.group_zscore(r, ids, 3)
  std0 = np.std([1.0, 3.0, 4.0], ddof=1)
  std1 = np.std([0.0, 2.0], ddof=1)
  np.testing.assert_allclose(
      np.asarray(z), [(1 - 8 / 3) / (std0 + 1e-6), -1 / (std1 + 1e-6),
                      (3 - 8 / 3) / (std0 + 1e-6), 1 / (std1 + 1e-6), 0.0,
                      (4 - 8 / 3) / (std0 + 1e-6)], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(adv_lib.rloo(r, ids, 3)),
                             [1 - 3.5, 0 - 2, 3 - 2.5, 2 - 0, 0.0, 4 - 2],
                             rtol=1e-6)
  with pytest.raises(ValueError, match="num_groups"):
    adv_lib.group_mean(r, ids)
  with pytest.raises(ValueError, match="group_size"):
    adv_lib.group_mean(r)


def test_batch_whiten_and_reinforce_pp():
  rng = np.random.default_rng(10)
  a = rng.normal(2.0, 3.0, size=(3, 6)).astype(np.float32)
  mask = (rng.random((3, 6)) < 0.6).astype(np.float32)
  mask[0, :2] = 1
  w = np.asarray(adv_lib.batch_whiten(a, mask))
  on = mask > 0
  ref = (a[on] - a[on].mean()) / (a[on].std() + 1e-8)
  np.testing.assert_allclose(w[on], ref, rtol=1e-5, atol=1e-5)
  assert np.all(w[~on] == 0.0)
  np.testing.assert_allclose(w[on].mean(), 0.0, atol=1e-6)
  np.testing.assert_allclose(w[on].std(), 1.0, rtol=1e-5)
  rewards = np.zeros((3, 6), np.float32)
  rewards[:, -1] = [1.0, 0.0, 2.0]
  rpp = np.asarray(adv_lib.reinforce_pp_advantages(rewards, mask, gamma=1.0))
  rtg = np.where(on, np.cumsum(rewards[:, ::-1], 1)[:, ::-1], 0.0)
  rtg = np.where(np.cumsum(mask, 1) > 0, rtg, 0.0)
  np.testing.assert_allclose(rpp[on], (rtg[on] - rtg[on].mean()) /
                             (rtg[on].std() + 1e-8), rtol=1e-5, atol=1e-5)
  # An all-empty mask gives zeros, not NaN.
  assert np.all(np.asarray(adv_lib.batch_whiten(a, np.zeros_like(mask))) == 0)


def test_broadcast_to_tokens():
  out = adv_lib.broadcast_to_tokens(jnp.array([2.0, -1.0]),
                                    jnp.array([[0, 1, 1], [1, 0, 0]]))
  np.testing.assert_array_equal(np.asarray(out), [[0, 2, 2], [-1, 0, 0]])


# ----------------------------------------------------------------------------
# Running-mean baseline.
# ----------------------------------------------------------------------------


def test_running_mean_baseline_hand_computed():
  state = adv_lib.running_mean_init(num_prompts=3, k=3)
  update = jax.jit(adv_lib.running_mean_update)
  # Prompt 0 gets 1, 2 in one batch (repeated id), prompt 2 gets 10.
  state = update(state, jnp.array([0, 0, 2]), jnp.array([1.0, 2.0, 10.0]))
  base = adv_lib.running_mean_baseline(state, jnp.array([0, 1, 2]),
                                       default=-7.0)
  np.testing.assert_allclose(np.asarray(base), [1.5, -7.0, 10.0])
  # Prompt 0: 3, 4 -> the ring holds the last k=3 rewards {2, 3, 4}.
  state = update(state, jnp.array([0, 0]), jnp.array([3.0, 4.0]))
  np.testing.assert_allclose(
      np.asarray(adv_lib.running_mean_baseline(state, jnp.array([0]))), [3.0])
  np.testing.assert_array_equal(np.asarray(state.count), [4, 0, 1])
  # Advantages use the baseline *before* this batch, then record it.
  adv, state = adv_lib.running_mean_advantages(state, jnp.array([0, 2]),
                                               jnp.array([5.0, 4.0]))
  np.testing.assert_allclose(np.asarray(adv), [5.0 - 3.0, 4.0 - 10.0])
  np.testing.assert_allclose(
      np.asarray(adv_lib.running_mean_baseline(state, jnp.array([0, 2]))),
      [(3 + 4 + 5) / 3, 7.0])
  with pytest.raises(ValueError, match="k must be"):
    adv_lib.running_mean_init(2, 0)


def test_running_mean_baseline_matches_numpy_deque():
  rng = np.random.default_rng(12)
  k, p = 4, 5
  state = adv_lib.running_mean_init(p, k)
  history = {i: [] for i in range(p)}
  for _ in range(6):
    ids = rng.integers(0, p, size=7)
    rs = rng.normal(size=7).astype(np.float32)
    adv, state = adv_lib.running_mean_advantages(state, ids, rs)
    base = np.array([np.mean(history[i][-k:]) if history[i] else 0.0
                     for i in ids])
    np.testing.assert_allclose(np.asarray(adv), rs - base, rtol=1e-5,
                               atol=1e-6)
    for i, r in zip(ids, rs):
      history[int(i)].append(float(r))


# ----------------------------------------------------------------------------
# DAPO.
# ----------------------------------------------------------------------------


def test_dynamic_sampling_keep():
  r = np.array([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0],
                [0.5, 0.5, 0.25]])
  np.testing.assert_array_equal(
      np.asarray(adv_lib.dynamic_sampling_keep(r)),
      [[False] * 3, [True] * 3, [False] * 3, [True] * 3])
  ids = np.array([0, 1, 0, 2])
  keep = adv_lib.dynamic_sampling_keep(np.array([1.0, 0.0, 0.0, 1.0]), ids, 3)
  np.testing.assert_array_equal(np.asarray(keep), [True, False, True, False])


def test_overlong_penalty_hand_computed():
  lengths = jnp.array([10, 16, 17, 18, 20, 21, 100])
  out = jax.jit(functools.partial(adv_lib.overlong_penalty, max_len=20,
                                  cache_len=4))(lengths)
  np.testing.assert_allclose(np.asarray(out),
                             [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0])
  with pytest.raises(ValueError, match="cache_len"):
    adv_lib.overlong_penalty(lengths, max_len=20, cache_len=30)


def test_group_estimators_jit_match_numpy():
  r = np.array([3.0, 1.0, 2.0, 2.0, 0.0], np.float32)
  ids = np.array([1, 0, 1, 0, 1])
  static = ("num_groups",)
  z = jax.jit(adv_lib.group_zscore, static_argnames=static)(r, ids,
                                                            num_groups=2)
  g1 = np.array([3.0, 2.0, 0.0])
  np.testing.assert_allclose(
      np.asarray(z)[[0, 2, 4]], (g1 - g1.mean()) / (g1.std(ddof=1) + 1e-6),
      rtol=1e-5)
  np.testing.assert_allclose(
      np.asarray(z)[[1, 3]], np.array([-0.5, 0.5]) / (np.sqrt(0.5) + 1e-6),
      rtol=1e-5)
  loo = jax.jit(adv_lib.rloo, static_argnames=static)(r, ids, num_groups=2)
  np.testing.assert_allclose(np.asarray(loo), [2.0, -1.0, 0.5, 1.0, -2.5],
                             rtol=1e-6)
  keep = jax.jit(adv_lib.dynamic_sampling_keep, static_argnames=static)(
      np.array([1.0, 1.0, 0.0, 1.0, 0.0]), ids, num_groups=2)
  np.testing.assert_array_equal(np.asarray(keep), [True, False, True, False,
                                                   True])
