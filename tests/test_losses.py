"""Tests for sao_jax.rl.losses and registry against float64 NumPy references.

Each reference below is written from the paper formula, not from the JAX code:
the loss value in float64 and the analytic gradient w.r.t. logp (per-token
aggregation weight × the derivative of the surrogate), checked on inputs that
put tokens in every region (inside the band, below it, above it; A>0 and A<0;
masked tokens).
"""

import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from sao_jax.rl import losses
from sao_jax.rl import metrics as rl_metrics
from sao_jax.rl import registry


RTOL = 2e-5
ATOL = 2e-6


# ----------------------------------------------------------------------------
# NumPy references.
# ----------------------------------------------------------------------------


def np_agg_weights(m, mode, constant=None):
  """Per-token weights w with aggregate(x) = Σ w·x (written independently)."""
  m = np.asarray(m, np.float64)
  b, t = m.shape
  if mode == "token_mean":
    return m / max(m.sum(), 1.0)
  if mode == "seq_mean_token_mean":
    n = m.sum(1, keepdims=True)
    rows = max((n > 0).sum(), 1)
    return np.where(n > 0, m / np.maximum(n, 1.0), 0.0) / rows
  if mode == "seq_mean_token_sum":
    n = m.sum(1, keepdims=True)
    rows = max((n > 0).sum(), 1)
    return m / rows
  if mode == "token_sum_norm":
    c = t if constant is None else constant
    return m / (b * c)
  raise AssertionError(mode)


def np_weighted_ppo(lp, old, adv, m, el, eh, *, weight=None, dual=None,
                    mode="token_mean", constant=None):
  """−Σ w_agg·W·surr and its gradient; surr = PPO clip (optional dual clip)."""
  lp, old, adv = (np.asarray(a, np.float64) for a in (lp, old, adv))
  weight = (np.ones_like(lp) if weight is None else
            np.asarray(weight, np.float64))
  r = np.exp(lp - old)
  surr = np.minimum(r * adv, np.clip(r, 1 - el, 1 + eh) * adv)
  # The unclipped branch (gradient r·A) is active except where PPO clips.
  unclipped = ~(((adv > 0) & (r > 1 + eh)) | ((adv < 0) & (r < 1 - el)))
  dsurr = np.where(unclipped, r * adv, 0.0)
  if dual is not None:
    dual_on = (adv < 0) & (dual * adv > surr)
    surr = np.where(dual_on, dual * adv, surr)
    dsurr = np.where(dual_on, 0.0, dsurr)
  w = np_agg_weights(m, mode, constant)
  loss = -np.sum(w * weight * surr)
  grad = -w * weight * dsurr
  return loss, grad


def np_dis(lp, rollout, adv, m, el, eh):
  """SAO Eqs. 1-3: f(r)=r inside (1−ε_l, 1+ε_h), else 0; grad = −f(r)·A/N."""
  lp, rollout, adv = (np.asarray(a, np.float64) for a in (lp, rollout, adv))
  m = np.asarray(m, np.float64)
  r = np.exp(lp - rollout)
  f = np.where((r > 1 - el) & (r < 1 + eh), r, 0.0)
  n = max(m.sum(), 1.0)
  loss = -np.sum(m * f * adv * lp) / n
  grad = -m * f * adv / n
  return loss, grad


def np_k3(lp, ref, w):
  d = np.asarray(ref, np.float64) - np.asarray(lp, np.float64)
  return np.sum(w * (np.exp(d) - d - 1)), w * (1 - np.exp(d))


def grad_of(fn, logp, *args, **kwargs):
  return jax.grad(lambda x: fn(x, *args, **kwargs)[0])(logp)


def check(actual_loss, actual_grad, ref_loss, ref_grad):
  np.testing.assert_allclose(float(actual_loss), ref_loss, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(np.asarray(actual_grad), ref_grad, rtol=RTOL,
                             atol=ATOL)


# ----------------------------------------------------------------------------
# Fixed inputs with tokens in every region.
# ----------------------------------------------------------------------------

# Ratios r = π_θ/π_denominator chosen away from every band edge used below:
# PPO (0.8, 1.2), clip-higher (0.8, 1.28), DIS (0.7, 6.0), dual clip c=3.
_RATIOS = np.array([
    [0.5, 0.75, 0.95, 1.1, 1.5, 4.0, 7.0, 0.5, 0.95, 1.5],
    [7.0, 7.0, 0.75, 1.1, 0.5, 1.5, 0.95, 2.0, 1.0, 1.0],
])
_ADV = np.array([
    [1.3, 1.3, 1.3, 1.3, 1.3, -0.7, -0.7, -0.7, -0.7, -0.7],
    [1.1, -0.6, -0.9, -1.2, 0.8, -0.4, 0.5, 1.7, 2.0, -3.0],
])
_MASK = np.array([
    [1, 1, 1, 1, 1, 1, 1, 1, 0, 1],
    [1, 1, 1, 1, 1, 1, 1, 0, 0, 0],
], np.float32)


def fixed_inputs(seed=0):
  rng = np.random.default_rng(seed)
  denom = -np.abs(rng.normal(1.0, 0.5, _RATIOS.shape)) - 0.1
  logp = denom + np.log(_RATIOS)
  return (logp.astype(np.float32), denom.astype(np.float32),
          _ADV.astype(np.float32), _MASK)


# ----------------------------------------------------------------------------
# DIS (SAO Eqs. 1-3).
# ----------------------------------------------------------------------------


def test_dis_value_and_gradient_against_numpy():
  logp, rollout, adv, mask = fixed_inputs()
  loss, metrics = losses.dis_policy_loss(logp, rollout, adv, mask,
                                         eps_low=0.3, eps_high=5.0)
  grad = grad_of(losses.dis_policy_loss, jnp.asarray(logp), rollout, adv, mask,
                 eps_low=0.3, eps_high=5.0)
  ref_loss, ref_grad = np_dis(logp, rollout, adv, mask, 0.3, 5.0)
  check(loss, grad, ref_loss, ref_grad)

  r = _RATIOS
  n = mask.sum()
  inside = (r > 0.7) & (r < 6.0) & (mask > 0)
  outside = ~((r > 0.7) & (r < 6.0)) & (mask > 0)
  # Every region is exercised with both signs of A.
  for region in (inside, (r <= 0.7) & (mask > 0), (r >= 6.0) & (mask > 0)):
    assert (region & (_ADV > 0)).any() and (region & (_ADV < 0)).any()
  g = np.asarray(grad)
  np.testing.assert_allclose(g[inside], -(r * _ADV)[inside] / n, rtol=1e-5)
  assert np.all(g[outside] == 0.0)
  assert np.all(g[mask == 0] == 0.0)

  np.testing.assert_allclose(metrics["accept_frac"], inside.sum() / n,
                             rtol=1e-6)
  np.testing.assert_allclose(metrics["reject_low_frac"],
                             ((r <= 0.7) & (mask > 0)).sum() / n, rtol=1e-6)
  np.testing.assert_allclose(metrics["reject_high_frac"],
                             ((r >= 6.0) & (mask > 0)).sum() / n, rtol=1e-6)
  on = mask > 0
  np.testing.assert_allclose(metrics["ratio_mean"], r[on].mean(), rtol=1e-5)
  np.testing.assert_allclose(metrics["ratio_min"], r[on].min(), rtol=1e-5)
  np.testing.assert_allclose(metrics["ratio_max"], r[on].max(), rtol=1e-5)
  np.testing.assert_allclose(metrics["kl_k2"],
                             0.5 * np.mean(np.log(r[on]) ** 2), rtol=1e-5)


def test_dis_hand_computed_two_tokens():
  # Token 0: r = 1.5 inside (0.7, 6), A = 2 -> grad −1.5·2/3 = −1.
  # Token 1: r = 0.5 below, A = 4 -> 0.  Token 2: r = 8 above, A = −1 -> 0.
  # Token 3: masked. N = 3 (rejected tokens still count).
  rollout = np.log(np.array([[0.2, 0.4, 0.1, 0.3]], np.float32))
  logp = rollout + np.log(np.array([[1.5, 0.5, 8.0, 1.0]], np.float32))
  adv = np.array([[2.0, 4.0, -1.0, 9.0]], np.float32)
  mask = np.array([[1, 1, 1, 0]], np.float32)
  loss, _ = losses.dis_policy_loss(logp, rollout, adv, mask, eps_low=0.3,
                                   eps_high=5.0)
  grad = grad_of(losses.dis_policy_loss, jnp.asarray(logp), rollout, adv, mask,
                 eps_low=0.3, eps_high=5.0)
  np.testing.assert_allclose(np.asarray(grad), [[-1.0, 0.0, 0.0, 0.0]],
                             atol=1e-6)
  np.testing.assert_allclose(float(loss), -(1.5 * 2.0 * np.log(0.3)) / 3,
                             rtol=1e-5)


def test_ppo_and_dis_differ_exactly_where_the_paper_says():
  """A>0, r<1−ε: PPO keeps gradient −r·A/N, DIS none; same for A<0, r>1+ε."""
  rollout = np.log(np.array([[0.5, 0.5, 0.5]], np.float32))
  ratios = np.array([[0.5, 8.0, 1.1]], np.float32)
  logp = rollout + np.log(ratios)
  adv = np.array([[1.0, -1.0, 1.0]], np.float32)
  mask = np.ones((1, 3), np.float32)
  eps = dict(eps_low=0.3, eps_high=5.0)
  g_ppo = np.asarray(grad_of(losses.ppo_clip_loss, jnp.asarray(logp), rollout,
                             adv, mask, **eps))
  g_dis = np.asarray(grad_of(losses.dis_policy_loss, jnp.asarray(logp),
                             rollout, adv, mask, **eps))
  np.testing.assert_allclose(g_ppo[0], -ratios[0] * adv[0] / 3, rtol=1e-5)
  np.testing.assert_allclose(g_dis[0], [0.0, 0.0, -1.1 / 3], rtol=1e-5)


# ----------------------------------------------------------------------------
# PPO family.
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean",
                                  "token_sum_norm"])
@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.2, 0.28)])
def test_ppo_clip_against_numpy(mode, eps):
  logp, old, adv, mask = fixed_inputs(1)
  kw = dict(eps_low=eps[0], eps_high=eps[1], aggregation=mode)
  loss, metrics = losses.ppo_clip_loss(logp, old, adv, mask, **kw)
  grad = grad_of(losses.ppo_clip_loss, jnp.asarray(logp), old, adv, mask, **kw)
  ref_loss, ref_grad = np_weighted_ppo(logp, old, adv, mask, *eps, mode=mode)
  check(loss, grad, ref_loss, ref_grad)
  r, a = _RATIOS, _ADV
  clipped = (((a > 0) & (r > 1 + eps[1])) | ((a < 0) & (r < 1 - eps[0])))
  assert clipped[mask > 0].any() and (~clipped)[mask > 0].any()
  np.testing.assert_allclose(metrics["clip_frac"], clipped[mask > 0].mean(),
                             rtol=1e-6)


def test_dual_clip_ppo_against_numpy():
  logp, old, adv, mask = fixed_inputs(2)
  dual_clip_ppo = registry.get_spec("dual_clip_ppo").bind()
  loss, metrics = dual_clip_ppo(logp, old, adv, mask)
  grad = grad_of(dual_clip_ppo, jnp.asarray(logp), old, adv, mask)
  ref_loss, ref_grad = np_weighted_ppo(logp, old, adv, mask, 0.2, 0.2, dual=3.0)
  check(loss, grad, ref_loss, ref_grad)
  # Tokens with A<0 and r>3 (r=4, r=7) are dual-clipped: no gradient.
  dual = (_ADV < 0) & (_RATIOS > 3.0) & (mask > 0)
  assert dual.sum() == 3
  assert np.all(np.asarray(grad)[dual] == 0.0)
  np.testing.assert_allclose(metrics["dual_clip_frac"], dual.sum() / mask.sum(),
                             rtol=1e-6)
  with pytest.raises(ValueError, match="dual_clip must be > 1"):
    losses.ppo_clip_loss(logp, old, adv, mask, dual_clip=0.5)


def test_grpo_with_k3_kl_against_numpy():
  logp, old, adv, mask = fixed_inputs(3)
  ref = old + np.float32(0.3) * np.sin(np.arange(old.size)).reshape(old.shape)
  ref = ref.astype(np.float32)
  grpo = registry.get_spec("grpo").bind()
  loss, metrics = grpo(logp, old, adv, mask, ref_logp=ref, kl_coef=0.04)
  grad = grad_of(grpo, jnp.asarray(logp), old, adv, mask,
                 ref_logp=ref, kl_coef=0.04)
  pg, pg_grad = np_weighted_ppo(logp, old, adv, mask, 0.2, 0.28,
                                mode="seq_mean_token_mean")
  w = np_agg_weights(mask, "seq_mean_token_mean")
  kl, kl_grad = np_k3(logp, ref, w)
  check(loss, grad, pg + 0.04 * kl, pg_grad + 0.04 * kl_grad)
  np.testing.assert_allclose(metrics["kl_ref_k3"], kl, rtol=1e-5)
  np.testing.assert_allclose(metrics["pg_loss"], pg, rtol=1e-5)
  assert kl > 0


def test_dr_grpo_uses_constant_normaliser():
  logp, old, adv, mask = fixed_inputs(4)
  dr_grpo = registry.get_spec("dr_grpo").bind()
  loss, _ = dr_grpo(logp, old, adv, mask, constant=64)
  grad = grad_of(dr_grpo, jnp.asarray(logp), old, adv, mask,
                 constant=64)
  ref_loss, ref_grad = np_weighted_ppo(logp, old, adv, mask, 0.2, 0.2,
                                       mode="token_sum_norm", constant=64)
  check(loss, grad, ref_loss, ref_grad)
  # Two rows, C=64: every unclipped token's gradient is −r·A/128.
  g = np.asarray(grad)
  np.testing.assert_allclose(g[0, 2], -0.95 * 1.3 / 128, rtol=1e-5)


def test_dapo_token_mean_clip_higher():
  logp, old, adv, mask = fixed_inputs(5)
  dapo = registry.get_spec("dapo").bind()
  loss, _ = dapo(logp, old, adv, mask)
  grad = grad_of(dapo, jnp.asarray(logp), old, adv, mask)
  check(loss, grad, *np_weighted_ppo(logp, old, adv, mask, 0.2, 0.28))


def np_gspo(lp, old, seq_adv, m, el, eh):
  """Pure sequence-level GSPO (Zheng 2025, Eq. 5/7) in float64."""
  m = np.asarray(m, np.float64)
  n = m.sum(1)
  s = np.exp(np.sum(m * (lp - old), 1) / np.maximum(n, 1))
  obj = np.minimum(s * seq_adv, np.clip(s, 1 - el, 1 + eh) * seq_adv)
  rows = max((n > 0).sum(), 1)
  return -np.sum(np.where(n > 0, obj, 0.0)) / rows


def test_gspo_equals_sequence_level_gspo():
  rng = np.random.default_rng(6)
  b, t = 4, 6
  old = (-np.abs(rng.normal(1, 0.3, (b, t))) - 0.1).astype(np.float32)
  mask = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 1, 0],
                   [1, 1, 1, 1, 1, 0]], np.float32)
  # Per-row mean log-ratio: in band, above (>4e-4), below (<−3e-4), in band.
  target = np.array([1e-4, 2e-3, -2e-3, -1e-4])
  noise = rng.normal(0, 1e-3, (b, t))
  noise -= (noise * mask).sum(1, keepdims=True) / mask.sum(1, keepdims=True)
  logp = (old + target[:, None] + noise * mask).astype(np.float32)
  seq_adv = np.array([0.9, 1.5, -0.8, -1.1])
  adv = np.repeat(seq_adv[:, None], t, 1).astype(np.float32)
  loss, metrics = losses.gspo_loss(logp, old, adv, mask)
  grad = np.asarray(grad_of(losses.gspo_loss, jnp.asarray(logp), old, adv,
                            mask))
  lp64, old64 = logp.astype(np.float64), old.astype(np.float64)
  np.testing.assert_allclose(float(loss), np_gspo(lp64, old64, seq_adv, mask,
                                                  3e-4, 4e-4), rtol=1e-5)
  # Analytic gradient of sequence GSPO: −(1/B) s_i A_i / |y_i| if the sequence
  # is not clipped (rows 0 and 3), else 0 (row 1: A>0, s>1+ε; row 2: A<0,
  # s<1−ε).
  n = mask.sum(1)
  s = np.exp(np.sum(mask * (lp64 - old64), 1) / n)
  expected = np.zeros((b, t))
  for i in (0, 3):
    expected[i] = -mask[i] * s[i] * seq_adv[i] / n[i] / b
  np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-7)
  # Central finite differences of the float64 reference agree too.
  h = 1e-6
  fd = np.zeros((b, t))
  for i in range(b):
    for j in range(t):
      up, dn = lp64.copy(), lp64.copy()
      up[i, j] += h
      dn[i, j] -= h
      fd[i, j] = (np_gspo(up, old64, seq_adv, mask, 3e-4, 4e-4) -
                  np_gspo(dn, old64, seq_adv, mask, 3e-4, 4e-4)) / (2 * h)
  np.testing.assert_allclose(grad, fd, rtol=1e-3, atol=1e-6)
  np.testing.assert_allclose(metrics["seq_out_of_band_frac"], 0.5)


def test_cispo_keeps_gradient_on_clipped_tokens():
  logp, old, adv, mask = fixed_inputs(7)
  loss, _ = losses.cispo_loss(logp, old, adv, mask, eps_low=1.0, eps_high=0.28)
  grad = grad_of(losses.cispo_loss, jnp.asarray(logp), old, adv, mask,
                 eps_low=1.0, eps_high=0.28)
  w = np.clip(_RATIOS, 0.0, 1.28)
  n = mask.sum()
  lp64 = logp.astype(np.float64)
  ref_loss = -np.sum(mask * w * _ADV * lp64) / n
  ref_grad = -mask * w * _ADV / n
  check(loss, grad, ref_loss, ref_grad)
  # r=7, A=−0.7: DIS would drop it, PPO would keep r·A; CISPO uses clip(r)=1.28.
  np.testing.assert_allclose(np.asarray(grad)[0, 6], 1.28 * 0.7 / n, rtol=1e-5)


def test_areal_decoupled_ppo_against_numpy():
  logp, prox, adv, mask = fixed_inputs(8)
  behav_ratio = np.array([0.3, 1.0, 2.5, 1.2] * 5)[:20].reshape(2, 10)
  # π_prox/π_behav = behav_ratio.
  rollout = (prox - np.log(behav_ratio)).astype(np.float32)
  for cap in (None, 2.0):
    loss, metrics = losses.areal_loss(logp, prox, rollout, adv, mask,
                                      behav_weight_cap=cap)
    grad = grad_of(losses.areal_loss, jnp.asarray(logp), prox, rollout, adv,
                   mask, behav_weight_cap=cap)
    w = behav_ratio if cap is None else np.where(behav_ratio > cap, 0.0,
                                                 behav_ratio)
    check(loss, grad, *np_weighted_ppo(logp, prox, adv, mask, 0.2, 0.2,
                                       weight=w))
  np.testing.assert_allclose(metrics["behav_weight_capped_frac"],
                             ((behav_ratio > 2.0) & (mask > 0)).sum() /
                             mask.sum(), rtol=1e-6)


@pytest.mark.parametrize("use_old", [True, False])
def test_tis_and_icepop_against_numpy(use_old):
  logp, old, adv, mask = fixed_inputs(9)
  k = np.array([0.3, 1.0, 3.0, 6.0, 0.8] * 4).reshape(2, 10)  # π_old/π_rollout.
  if use_old:
    rollout = (old - np.log(k)).astype(np.float32)
    old_arg, old_ref = old, old
  else:  # π_old = sg(π_θ): r = 1 everywhere, k = π_θ/π_rollout.
    rollout = (logp - np.log(k)).astype(np.float32)
    old_arg, old_ref = None, logp
  loss, _ = losses.tis_loss(logp, rollout, adv, mask, old_logp=old_arg, cap=2.0)
  grad = grad_of(losses.tis_loss, jnp.asarray(logp), rollout, adv, mask,
                 old_logp=old_arg, cap=2.0)
  check(loss, grad, *np_weighted_ppo(logp, old_ref, adv, mask, 0.2, 0.2,
                                     weight=np.minimum(k, 2.0)))
  loss, metrics = losses.icepop_loss(logp, rollout, adv, mask, old_logp=old_arg)
  grad = grad_of(losses.icepop_loss, jnp.asarray(logp), rollout, adv, mask,
                 old_logp=old_arg)
  w = np.where((k >= 0.5) & (k <= 5.0), k, 0.0)
  check(loss, grad, *np_weighted_ppo(logp, old_ref, adv, mask, 0.2, 0.28,
                                     weight=w))
  np.testing.assert_allclose(metrics["icepop_masked_frac"],
                             (mask * (w == 0)).sum() / mask.sum(), rtol=1e-6)


def test_icepop_on_policy_gradient_equals_dis_with_same_band():
  """With π_old = sg(π_θ), IcePop's gradient is DIS's with band [α, β]."""
  logp, rollout, adv, mask = fixed_inputs(10)
  g_ice = grad_of(losses.icepop_loss, jnp.asarray(logp), rollout, adv, mask,
                  mismatch_low=0.6, mismatch_high=5.0)
  g_dis = grad_of(losses.dis_policy_loss, jnp.asarray(logp), rollout, adv, mask,
                  eps_low=0.4, eps_high=4.0)
  np.testing.assert_allclose(np.asarray(g_ice), np.asarray(g_dis), rtol=1e-5,
                             atol=1e-7)
  assert np.count_nonzero(np.asarray(g_dis)) > 0


# ----------------------------------------------------------------------------
# aggregate, value loss, explained variance.
# ----------------------------------------------------------------------------


def test_aggregate_hand_computed():
  x = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
  m = jnp.array([[1, 1, 1], [0, 1, 0], [0, 0, 0]])
  assert float(losses.aggregate(x, m, "token_mean")) == pytest.approx(11 / 4)
  assert float(losses.aggregate(x, m, "seq_mean_token_mean")) == pytest.approx(
      (2.0 + 5.0) / 2)
  assert float(losses.aggregate(x, m, "seq_mean_token_sum")) == pytest.approx(
      (6.0 + 5.0) / 2)
  assert float(losses.aggregate(x, m, "token_sum_norm")) == pytest.approx(
      11 / (3 * 3))
  assert float(losses.aggregate(x, m, "token_sum_norm",
                                constant=10)) == pytest.approx(11 / 30)
  for mode in losses.AGGREGATIONS:
    assert float(losses.aggregate(x, jnp.zeros_like(m), mode)) == 0.0
  with pytest.raises(ValueError, match="token_mean"):
    losses.aggregate(x, m, "sum")


def test_value_loss_mse_and_gradient():
  rng = np.random.default_rng(11)
  v = rng.normal(size=(3, 5)).astype(np.float32)
  ret = rng.normal(size=(3, 5)).astype(np.float32)
  m = (rng.random((3, 5)) > 0.4).astype(np.float32)
  m[0, 0] = 1
  loss, metrics = losses.value_loss(v, ret, m)
  grad = jax.grad(lambda x: losses.value_loss(x, ret, m)[0])(jnp.asarray(v))
  n = m.sum()
  np.testing.assert_allclose(float(loss), np.sum(m * (v - ret) ** 2) / n,
                             rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grad), 2 * m * (v - ret) / n, rtol=1e-5,
                             atol=1e-7)
  on = m > 0
  ev = 1 - np.var(ret[on] - v[on]) / np.var(ret[on])
  np.testing.assert_allclose(metrics["explained_variance"], ev, rtol=1e-4)


def test_value_loss_clipped_hand_computed():
  # Token 0: V=1, R=3, V_old=0, c=0.5 -> V_clip=0.5: max(4, 6.25)=6.25, grad 0.
  # Token 1: V=1, R=0, V_old=0 -> max(1, 0.25)=1, grad 2·1/2 = 1.
  v = jnp.array([[1.0, 1.0]])
  ret = jnp.array([[3.0, 0.0]])
  old = jnp.array([[0.0, 0.0]])
  m = jnp.ones((1, 2))
  f = lambda x: losses.value_loss(x, ret, m, old_values=old, clip=0.5)
  loss, metrics = f(v)
  assert float(loss) == pytest.approx((6.25 + 1.0) / 2)
  np.testing.assert_allclose(np.asarray(jax.grad(lambda x: f(x)[0])(v)),
                             [[0.0, 1.0]], atol=1e-7)
  assert float(metrics["value_clip_frac"]) == pytest.approx(0.5)
  with pytest.raises(ValueError, match="old_values"):
    losses.value_loss(v, ret, m, clip=0.5)


def test_explained_variance_cases():
  ret = jnp.array([[1.0, 2.0, 3.0, 100.0]])
  m = jnp.array([[1, 1, 1, 0]])
  assert float(rl_metrics.explained_variance(ret, ret, m)) == pytest.approx(1.0)
  mean = jnp.full_like(ret, 2.0)
  ev_mean = float(rl_metrics.explained_variance(mean, ret, m))
  assert ev_mean == pytest.approx(0.0, abs=1e-6)
  ev = rl_metrics.explained_variance
  assert float(ev(ret, ret, jnp.zeros_like(m))) == 0.0
  # Returns constant up to float32 rounding (Var ~1e-15): undefined -> 0, not
  # 1 - Var(R - V) / 1e-15 ~ -1e13 (seen when every reward of a batch is 0).
  flat = jnp.array([[0.1, 0.1 + 3e-8, 0.1, 0.1]], jnp.float32)
  off = jnp.full_like(flat, 0.5)
  assert float(ev(off, flat, jnp.ones_like(flat))) == 0.0


# ----------------------------------------------------------------------------
# Registry.
# ----------------------------------------------------------------------------

ALL = registry.known_losses()
REQUIRED = ("sao", "dis", "ppo", "dual_clip_ppo", "grpo", "grpo_dis", "dr_grpo",
            "dapo", "gspo", "cispo", "areal", "tis", "icepop", "vapo",
            "reinforce_pp")


def make_batch(logp, rollout, adv, mask, with_ref=True):
  return registry.PolicyBatch(
      rollout_logp=jnp.asarray(rollout), advantages=jnp.asarray(adv),
      mask=jnp.asarray(mask), old_logp=jnp.asarray(rollout) + 0.05,
      prox_logp=jnp.asarray(rollout) - 0.05,
      ref_logp=jnp.asarray(rollout) + 0.1 if with_ref else None)


def test_registry_has_every_algorithm_and_rejects_unknown():
  assert set(REQUIRED) <= set(ALL)
  with pytest.raises(ValueError, match="known losses: .*sao"):
    registry.get_loss_fn("sao2")


def test_registry_dispatch_defaults_and_overrides():
  logp, rollout, adv, mask = fixed_inputs(12)
  batch = make_batch(logp, rollout, adv, mask)
  loss, _ = registry.get_loss_fn("sao")(jnp.asarray(logp), batch)
  direct, _ = losses.dis_policy_loss(logp, rollout, adv, mask, eps_low=0.3,
                                     eps_high=5.0)
  assert float(loss) == float(direct)
  cfg = ml_collections.ConfigDict(
      {"name": "sao", "eps_low": 0.8, "eps_high": 3.0, "unused_key": 7,
       "kl_coef": None})
  loss, _ = registry.get_loss_fn("dis", cfg)(jnp.asarray(logp), batch)
  direct, _ = losses.dis_policy_loss(logp, rollout, adv, mask, eps_low=0.8,
                                     eps_high=3.0)
  assert float(loss) == float(direct)
  assert registry.resolve_hparams("grpo", {"kl_coef": None}) == {
      "eps_low": 0.2, "eps_high": 0.28, "kl_coef": 0.0}
  # PPO without old_logp takes the ratio against the rollout log-probs.
  no_old = batch.replace(old_logp=None, ref_logp=None)
  loss, _ = registry.get_loss_fn("ppo")(jnp.asarray(logp), no_old)
  direct, _ = losses.ppo_clip_loss(logp, rollout, adv, mask)
  assert float(loss) == float(direct)
  with pytest.raises(ValueError, match="prox_logp"):
    registry.get_loss_fn("areal")(jnp.asarray(logp),
                                  no_old.replace(prox_logp=None))
  assert registry.get_spec("vapo").advantage == "vapo_gae"
  assert registry.get_spec("sao").advantage == "decoupled_gae"


# ----------------------------------------------------------------------------
# Properties over every registered loss: masking, jit, empty rows, extremes.
# ----------------------------------------------------------------------------

B, T = 3, 7


@functools.lru_cache(maxsize=None)
def jitted_value_and_grad(name):
  fn = registry.get_loss_fn(name, {"kl_coef": 0.1})

  def f(logp, batch):
    (loss, metrics), grad = jax.value_and_grad(fn, has_aux=True)(logp, batch)
    return loss, metrics, grad

  return jax.jit(f)


def random_arrays(seed, mask_p=0.6):
  rng = np.random.default_rng(seed)
  rollout = -np.abs(rng.normal(1.0, 0.7, (B, T))) - 0.05
  logp = rollout + rng.normal(0, 0.4, (B, T))
  adv = rng.normal(0, 1, (B, T))
  mask = (rng.random((B, T)) < mask_p).astype(np.float32)
  return [a.astype(np.float32) for a in (logp, rollout, adv)] + [mask]


@pytest.mark.parametrize("name", ALL)
@hypothesis.settings(max_examples=20, deadline=None)
@hypothesis.given(seed=st.integers(0, 2**31 - 1), junk=st.sampled_from(
    [0.0, 1e3, -1e3, np.nan, np.inf]))
def test_masked_tokens_never_matter(name, seed, junk):
  logp, rollout, adv, mask = random_arrays(seed)
  f = jitted_value_and_grad(name)
  batch = make_batch(logp, rollout, adv, mask)
  loss, metrics, grad = f(jnp.asarray(logp), batch)
  rng = np.random.default_rng(seed + 1)
  off = mask == 0

  def corrupt(a):
    noise = rng.normal(0, 30, a.shape) if junk == 0.0 else junk
    return np.where(off, noise, a).astype(np.float32)

  logp2, rollout2, adv2 = corrupt(logp), corrupt(rollout), corrupt(adv)
  batch2 = make_batch(logp2, rollout2, adv2, mask).replace(
      old_logp=jnp.asarray(corrupt(rollout + 0.05)),
      prox_logp=jnp.asarray(corrupt(rollout - 0.05)),
      ref_logp=jnp.asarray(corrupt(rollout + 0.1)))
  loss2, metrics2, grad2 = f(jnp.asarray(logp2), batch2)
  np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(grad2), np.asarray(grad), rtol=1e-6,
                             atol=1e-8)
  assert np.all(np.asarray(grad)[off] == 0.0)
  for k in metrics:
    np.testing.assert_allclose(float(metrics2[k]), float(metrics[k]),
                               rtol=1e-5, atol=1e-7, err_msg=k)


@pytest.mark.parametrize("name", ALL)
def test_empty_rows_and_extreme_ratios_are_finite(name):
  f = jitted_value_and_grad(name)
  logp, rollout, adv, mask = random_arrays(13, mask_p=1.0)
  mask[1] = 0.0  # An empty row.
  # Log-ratios of ±50 against every denominator.
  logp = rollout + np.where(np.arange(T) % 2 == 0, 50.0, -50.0)[None, :]
  logp = logp.astype(np.float32)
  batch = registry.PolicyBatch(
      rollout_logp=jnp.asarray(rollout), advantages=jnp.asarray(adv),
      mask=jnp.asarray(mask), old_logp=jnp.asarray(rollout),
      prox_logp=jnp.asarray(logp - 50.0), ref_logp=jnp.asarray(rollout - 50.0))
  loss, metrics, grad = f(jnp.asarray(logp), batch)
  assert np.isfinite(float(loss)), name
  assert np.all(np.isfinite(np.asarray(grad))), name
  assert np.all(np.asarray(grad)[1] == 0.0)
  for k, v in metrics.items():
    assert np.isfinite(float(v)), (name, k)
  # Everything masked: loss 0, gradient 0, metrics finite.
  empty = batch.replace(mask=jnp.zeros((B, T)))
  loss, metrics, grad = f(jnp.asarray(logp), empty)
  assert float(loss) == 0.0
  assert np.all(np.asarray(grad) == 0.0)
  for k, v in metrics.items():
    assert np.isfinite(float(v)), (name, k)


def test_dis_rejects_extreme_ratios_with_zero_gradient():
  rollout = np.full((1, 4), -1.0, np.float32)
  logp = rollout + np.array([[50.0, -50.0, 0.1, 0.0]], np.float32)
  adv = np.array([[1.0, -1.0, 2.0, 0.0]], np.float32)
  mask = np.ones((1, 4), np.float32)
  grad = np.asarray(grad_of(losses.dis_policy_loss, jnp.asarray(logp), rollout,
                            adv, mask))
  np.testing.assert_allclose(grad, [[0.0, 0.0, -np.exp(0.1) * 2 / 4, 0.0]],
                             rtol=1e-5)


def test_value_loss_and_aggregate_jit_match_eager():
  rng = np.random.default_rng(14)
  v, ret, old = (rng.normal(size=(2, 5)).astype(np.float32) for _ in range(3))
  m = np.array([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0]], np.float32)
  f = functools.partial(losses.value_loss, clip=0.2)
  eager, _ = f(v, ret, m, old_values=old)
  jitted, metrics = jax.jit(f)(v, ret, m, old_values=old)
  np.testing.assert_allclose(float(jitted), float(eager), rtol=1e-6)
  vc = old + np.clip(v - old, -0.2, 0.2)
  ref = np.maximum((v - ret) ** 2, (vc - ret) ** 2)[m > 0].mean()
  np.testing.assert_allclose(float(jitted), ref, rtol=1e-5)
  assert all(np.isfinite(float(x)) for x in metrics.values())
  agg = jax.jit(losses.aggregate, static_argnames=("mode",))
  np.testing.assert_allclose(float(agg(v, m, mode="seq_mean_token_mean")),
                             v[0, [0, 1, 3]].mean(), rtol=1e-6)


def test_value_loss_ignores_masked_contents():
  rng = np.random.default_rng(15)
  v, ret, old = (rng.normal(size=(3, 6)).astype(np.float32) for _ in range(3))
  m = (rng.random((3, 6)) < 0.5).astype(np.float32)
  m[0, 0] = 1.0
  m[2] = 0.0
  junk = lambda a: np.where(m > 0, a, np.nan).astype(np.float32)
  f = lambda x, r, o: losses.value_loss(x, r, m, old_values=o, clip=0.3)
  g = lambda x, r, o: jax.grad(lambda y: f(y, r, o)[0])(jnp.asarray(x))
  (l1, m1), (l2, m2) = f(v, ret, old), f(junk(v), junk(ret), junk(old))
  assert float(l1) == float(l2)
  for k in m1:
    assert float(m1[k]) == float(m2[k]), k
  g1, g2 = np.asarray(g(v, ret, old)), np.asarray(g(junk(v), junk(ret),
                                                    junk(old)))
  np.testing.assert_array_equal(g1, g2)
  assert np.all(g1[m == 0] == 0.0) and np.count_nonzero(g1) > 0
