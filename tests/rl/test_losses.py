"""Tests of each sao_jax.rl loss against a float64 NumPy reference.

Each reference below is written from the paper formula, not from the JAX code:
the loss value in float64 and the analytic gradient w.r.t. logp (per-token
aggregation weight × the derivative of the surrogate), checked on inputs that
put tokens in every region (inside the band, below it, above it; A>0 and A<0;
masked tokens). The registry and the properties every registered loss must
have: test_loss_registry.py.
"""

import jax.numpy as jnp
import numpy as np
import pytest

import loss_inputs
from sao_jax.rl import baselines
from sao_jax.rl import losses
from sao_jax.rl import registry


RTOL = 2e-5
ATOL = 2e-6
fixed_inputs, grad_of = loss_inputs.fixed_inputs, loss_inputs.grad_of
_RATIOS, _ADV, _MASK = loss_inputs.RATIOS, loss_inputs.ADV, loss_inputs.MASK


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


def check(actual_loss, actual_grad, ref_loss, ref_grad):
  np.testing.assert_allclose(float(actual_loss), ref_loss, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(np.asarray(actual_grad), ref_grad, rtol=RTOL,
                             atol=ATOL)


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
  g_ppo = np.asarray(grad_of(baselines.ppo_clip_loss, jnp.asarray(logp), rollout,
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
  loss, metrics = baselines.ppo_clip_loss(logp, old, adv, mask, **kw)
  grad = grad_of(baselines.ppo_clip_loss, jnp.asarray(logp), old, adv, mask, **kw)
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
    baselines.ppo_clip_loss(logp, old, adv, mask, dual_clip=0.5)


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
  loss, metrics = baselines.gspo_loss(logp, old, adv, mask)
  grad = np.asarray(grad_of(baselines.gspo_loss, jnp.asarray(logp), old, adv,
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
  loss, _ = baselines.cispo_loss(logp, old, adv, mask, eps_low=1.0, eps_high=0.28)
  grad = grad_of(baselines.cispo_loss, jnp.asarray(logp), old, adv, mask,
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
    loss, metrics = baselines.areal_loss(logp, prox, rollout, adv, mask,
                                      behav_weight_cap=cap)
    grad = grad_of(baselines.areal_loss, jnp.asarray(logp), prox, rollout, adv,
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
  loss, _ = baselines.tis_loss(logp, rollout, adv, mask, old_logp=old_arg, cap=2.0)
  grad = grad_of(baselines.tis_loss, jnp.asarray(logp), rollout, adv, mask,
                 old_logp=old_arg, cap=2.0)
  check(loss, grad, *np_weighted_ppo(logp, old_ref, adv, mask, 0.2, 0.2,
                                     weight=np.minimum(k, 2.0)))
  loss, metrics = baselines.icepop_loss(logp, rollout, adv, mask, old_logp=old_arg)
  grad = grad_of(baselines.icepop_loss, jnp.asarray(logp), rollout, adv, mask,
                 old_logp=old_arg)
  w = np.where((k >= 0.5) & (k <= 5.0), k, 0.0)
  check(loss, grad, *np_weighted_ppo(logp, old_ref, adv, mask, 0.2, 0.28,
                                     weight=w))
  np.testing.assert_allclose(metrics["icepop_masked_frac"],
                             (mask * (w == 0)).sum() / mask.sum(), rtol=1e-6)


def test_icepop_on_policy_gradient_equals_dis_with_same_band():
  """With π_old = sg(π_θ), IcePop's gradient is DIS's with band [α, β]."""
  logp, rollout, adv, mask = fixed_inputs(10)
  g_ice = grad_of(baselines.icepop_loss, jnp.asarray(logp), rollout, adv, mask,
                  mismatch_low=0.6, mismatch_high=5.0)
  g_dis = grad_of(losses.dis_policy_loss, jnp.asarray(logp), rollout, adv, mask,
                  eps_low=0.4, eps_high=4.0)
  np.testing.assert_allclose(np.asarray(g_ice), np.asarray(g_dis), rtol=1e-5,
                             atol=1e-7)
  assert np.count_nonzero(np.asarray(g_dis)) > 0


def test_dis_rejects_extreme_ratios_with_zero_gradient():
  rollout = np.full((1, 4), -1.0, np.float32)
  logp = rollout + np.array([[50.0, -50.0, 0.1, 0.0]], np.float32)
  adv = np.array([[1.0, -1.0, 2.0, 0.0]], np.float32)
  mask = np.ones((1, 4), np.float32)
  grad = np.asarray(grad_of(losses.dis_policy_loss, jnp.asarray(logp), rollout,
                            adv, mask))
  np.testing.assert_allclose(grad, [[0.0, 0.0, -np.exp(0.1) * 2 / 4, 0.0]],
                             rtol=1e-5)
