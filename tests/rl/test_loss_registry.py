"""The loss registry and properties every registered loss must have
(masked tokens never matter, jit, empty rows, extreme ratios), plus the
aggregation and the critic loss."""

import dataclasses
import functools

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

import loss_inputs
from sao_jax.rl import baselines
from sao_jax.rl import losses
from sao_jax.rl import metrics as rl_metrics
from sao_jax.rl import registry

fixed_inputs, grad_of = loss_inputs.fixed_inputs, loss_inputs.grad_of


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
  direct, _ = baselines.ppo_clip_loss(logp, rollout, adv, mask)
  assert float(loss) == float(direct)
  with pytest.raises(ValueError, match="prox_logp"):
    registry.get_loss_fn("areal")(jnp.asarray(logp),
                                  no_old.replace(prox_logp=None))
  assert registry.get_spec("vapo").advantage == "vapo_gae"
  assert registry.get_spec("sao").advantage == "decoupled_gae"


def _toy_loss(logp, rollout_logp, advantages, mask, *, scale=1.0):
  """−scale · mean over action tokens of A · logp (no ratio, no clip)."""
  del rollout_logp
  loss = -scale * losses.aggregate(advantages * logp, mask)
  return loss, {"toy_scale": jnp.float32(scale)}


def test_a_new_loss_is_one_register_loss_call(monkeypatch):
  # The train step calls its loss as get_loss_fn returns it, on a PolicyBatch.
  monkeypatch.setattr(registry, "_REGISTRY", registry._REGISTRY.copy())
  spec = registry.LossSpec(_toy_loss, ("rollout_logp",), "group_zscore",
                           "toy", hparams=("scale",))
  registry.register_loss("toy", spec)
  with pytest.raises(ValueError, match="already registered"):
    registry.register_loss("toy", spec)
  with pytest.raises(ValueError, match="unknown advantage estimator 'gea'"):
    registry.register_loss("toy2", dataclasses.replace(spec, advantage="gea"))
  logp, rollout, adv, mask = fixed_inputs(12)
  loss, metrics = registry.get_loss_fn("toy", {"scale": 2.0})(
      jnp.asarray(logp), make_batch(logp, rollout, adv, mask))
  on = mask > 0
  np.testing.assert_allclose(float(loss), -2.0 * (adv * logp)[on].mean(),
                             rtol=1e-5)
  assert float(metrics["toy_scale"]) == 2.0 and "toy" in registry.known_losses()


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
