"""Tests for the SAO train step: wiring of log-probs, values, critic and policy."""


import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sao_jax.models import logprobs as logprobs_lib
from sao_jax.models import transformer
from sao_jax.rl import advantages as adv_lib
from sao_jax.rl import losses
from sao_jax.train import optim
from sao_jax.train import step as step_lib

import tiny_models

# Compile-heavy (about 87 s as one Bazel target on 2 cores): //:fast_tests
# leaves it to the pytest run, which runs every test.
pytestmark = pytest.mark.slow

CFG = tiny_models.tiny_model_config()
TEMP = 0.7


def _params():
  """Policy and critic params, made once per process (steps get copies)."""
  return tiny_models.policy_and_critic(CFG)


def _batch(policy_params, seed=0):
  """Two rows: prompt(3) + actions, an observation gap, right padding."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(4, 32, (2, 12)).astype(np.int32)
  attn = np.ones((2, 12), bool)
  attn[1, 10:] = False
  action = np.zeros((2, 12), np.uint8)
  action[0, 3:7] = 1
  action[0, 9:12] = 1  # Tokens 7-8 are an environment observation.
  action[1, 3:10] = 1
  rewards = np.zeros((2, 12), np.float32)
  rewards[0, 11] = 1.0
  rewards[1, 9] = 0.0
  logp = logprobs_lib.token_logprobs(policy_params, CFG, jnp.asarray(tokens),
                                     jnp.asarray(attn), TEMP)
  # Make the rollout log-probs off-policy by known amounts on some tokens.
  shift = np.zeros((2, 12), np.float32)
  shift[0, 4] = 1.0  # r = e^-1 = 0.37 -> inside (0.3, ...)? no: 1-0.3=0.7.
  shift[1, 5] = -2.0  # r = e^2 = 7.4 > 1+5 -> rejected high.
  rollout = np.asarray(logp) + shift
  return {
      "tokens": jnp.asarray(tokens), "attention_mask": jnp.asarray(attn),
      "action_mask": jnp.asarray(action), "rewards": jnp.asarray(rewards),
      "rollout_logp": jnp.asarray(rollout * action),
      "prompt_id": jnp.asarray([0, 1]),
  }


def _sgd_step(cfg, update_policy=True):
  p, v = _params()
  ptx, vtx = optax.sgd(0.1), optax.sgd(0.05)
  state = step_lib.create_train_state(p, v, ptx, vtx)
  batch = _batch(p)
  fn = step_lib.make_step(CFG, cfg, ptx, vtx, update_policy=update_policy)
  new_state, metrics = fn(jax.tree.map(jnp.copy, state), batch)
  return p, v, batch, new_state, metrics


def _values(v_params, batch):
  pos = transformer.positions_from_mask(batch["attention_mask"])
  out = transformer.ValueModel(CFG).apply({"params": v_params},
                                          batch["tokens"], pos,
                                          batch["attention_mask"])
  return jnp.pad(out[:, :-1], ((0, 0), (1, 0)))


def test_policy_update_equals_manual_dis_gradient():
  cfg = step_lib.StepConfig(loss="sao", critic_updates_per_step=1,
                            temperature=TEMP)
  p, v, batch, new_state, metrics = _sgd_step(cfg)
  mask = batch["action_mask"]
  values = _values(v, batch)
  adv, _ = losses.decoupled_gae(batch["rewards"], values, mask, alpha=1.5)

  def manual(pp):
    logp = logprobs_lib.token_logprobs(pp, CFG, batch["tokens"],
                                       batch["attention_mask"], TEMP)
    return losses.dis_policy_loss(logp, batch["rollout_logp"], adv, mask,
                                  eps_low=0.3, eps_high=5.0)

  (loss, m), grads = jax.jit(jax.value_and_grad(manual, has_aux=True))(p)
  expected = jax.tree.map(lambda a, g: a - 0.1 * g, p, grads)
  for a, b in zip(jax.tree.leaves(new_state.policy_params),
                  jax.tree.leaves(expected)):
    np.testing.assert_allclose(a, b, atol=1e-6)
  assert float(metrics["policy/loss"]) == pytest.approx(float(loss), abs=1e-6)
  # 14 action tokens: token (0,4) has r=e^-1 < 0.7 (low), (1,5) r=e^2 > 6 (high).
  n = 14
  assert float(metrics["policy/reject_low_frac"]) == pytest.approx(1 / n)
  assert float(metrics["policy/reject_high_frac"]) == pytest.approx(1 / n)
  assert float(metrics["policy/accept_frac"]) == pytest.approx(12 / n)
  assert float(metrics["policy/dis_band_out_frac"]) == pytest.approx(2 / n)
  assert int(new_state.policy_version) == 1 and int(new_state.step) == 1


def test_critic_updates_k_times_on_returns():
  cfg = step_lib.StepConfig(loss="sao", critic_updates_per_step=2,
                            temperature=TEMP)
  p, v, batch, new_state, metrics = _sgd_step(cfg, update_policy=False)
  mask = batch["action_mask"]
  returns = adv_lib.reward_to_go(batch["rewards"], mask)  # lambda=1, gamma=1.
  vv = v

  @jax.jit
  def sgd(q):
    g = jax.grad(lambda q: losses.value_loss(_values(q, batch), returns,
                                             mask)[0])(q)
    return jax.tree.map(lambda a, b: a - 0.05 * b, q, g)
  for _ in range(2):
    vv = sgd(vv)
  for a, b in zip(jax.tree.leaves(new_state.value_params),
                  jax.tree.leaves(vv)):
    np.testing.assert_allclose(a, b, atol=1e-6)
  # Warm-up step: policy untouched, version unchanged.
  for a, b in zip(jax.tree.leaves(new_state.policy_params), jax.tree.leaves(p)):
    np.testing.assert_array_equal(a, b)
  assert int(new_state.policy_version) == 0 and int(new_state.step) == 1
  assert "policy/loss" not in metrics
  # Returns are reward-to-go: row 0 earns 1 on every action token, row 1 zero.
  np.testing.assert_allclose(float(metrics["returns/mean"]), 7 / 14, atol=1e-6)


def test_on_policy_batch_accepts_every_token():
  p, v = _params()
  batch = _batch(p)
  logp = logprobs_lib.token_logprobs(p, CFG, batch["tokens"],
                                     batch["attention_mask"], TEMP)
  batch["rollout_logp"] = logp * batch["action_mask"]
  ptx, vtx = optax.sgd(0.1), optax.sgd(0.1)
  state = step_lib.create_train_state(p, v, ptx, vtx)
  fn = step_lib.make_step(CFG, step_lib.StepConfig(temperature=TEMP), ptx, vtx,
                          update_policy=True)
  _, m = fn(jax.tree.map(jnp.copy, state), batch)
  assert float(m["policy/accept_frac"]) == 1.0
  assert float(m["policy/ratio_mean"]) == pytest.approx(1.0, abs=1e-5)
  assert np.isfinite(float(m["policy/entropy"]))
  assert float(m["policy/entropy"]) > 0


def test_frozen_attention_critic_keeps_attention():
  p, v = _params()
  labels = optim.frozen_attention_labels(v)
  vtx = optim.make_optimizer(1e-2, labels=labels)
  ptx = optax.sgd(0.0)
  state = step_lib.create_train_state(p, v, ptx, vtx)
  fn = step_lib.make_step(CFG, step_lib.StepConfig(temperature=TEMP), ptx, vtx,
                          update_policy=False)
  new, _ = fn(jax.tree.map(jnp.copy, state), _batch(p))  # state is donated.
  old_attn = v["decoder"]["layers"]["attn"]["q_proj"]
  np.testing.assert_array_equal(
      new.value_params["decoder"]["layers"]["attn"]["q_proj"], old_attn)
  assert not np.allclose(
      new.value_params["decoder"]["layers"]["mlp"]["up_proj"],
      v["decoder"]["layers"]["mlp"]["up_proj"])
  assert not np.allclose(new.value_params["value_head"]["kernel"],
                         v["value_head"]["kernel"])


def test_group_estimator_uses_group_index():
  p, v = _params()
  batch = _batch(p)
  batch["rewards"] = batch["rewards"].at[1, 9].set(0.0)
  batch["group_index"] = jnp.asarray([0, 0])
  ptx, vtx = optax.sgd(0.1), optax.sgd(0.1)
  state = step_lib.create_train_state(p, v, ptx, vtx)
  cfg = step_lib.StepConfig(loss="grpo", advantage="group_zscore",
                            max_groups=1, temperature=TEMP)
  fn = step_lib.make_step(CFG, cfg, ptx, vtx, update_policy=True)
  new, m = fn(jax.tree.map(jnp.copy, state), batch)
  # Rewards (1, 0) in one group: mean 0.5, sample std (ddof=1) 1/sqrt(2), so
  # z-scores +-1/sqrt(2) on each row's 7 action tokens.
  assert float(m["advantage/mean"]) == pytest.approx(0.0, abs=1e-5)
  assert float(m["advantage/std"]) == pytest.approx(2**-0.5, abs=1e-4)
  # No DIS in GRPO, yet the step reports what the paper's band would mask:
  # the same 2 of 14 tokens as the SAO step's (outside (1 - 0.3, 1 + 5.0)).
  assert "policy/accept_frac" not in m
  assert float(m["policy/dis_band_out_frac"]) == pytest.approx(2 / 14)
  # No critic in GRPO: value params untouched.
  for a, b in zip(jax.tree.leaves(new.value_params), jax.tree.leaves(v)):
    np.testing.assert_array_equal(a, b)


def test_unknown_names_raise():
  with pytest.raises(ValueError, match="Unknown loss 'sa0'"):
    step_lib.StepConfig(loss="sa0")
  with pytest.raises(ValueError, match="Unknown advantage estimator 'gea'"):
    step_lib.StepConfig(advantage="gea")


def test_kl_penalty_uses_the_frozen_reference_policy():
  p, v = _params()
  batch = _batch(p)
  batch["group_index"] = jnp.asarray([0, 1])
  ref = jax.tree.map(lambda x: x * 0.9, p)  # A reference unlike the policy.
  ptx, vtx = optax.sgd(0.1), optax.sgd(0.05)
  cfg = step_lib.StepConfig(loss="grpo", loss_hparams=(("kl_coef", 0.5),),
                            max_groups=2, temperature=TEMP)
  assert cfg.uses_reference and cfg.estimator == "group_zscore"
  assert not step_lib.StepConfig(
      loss="grpo", loss_hparams=(("kl_coef", 0.0),)).uses_reference
  fn = step_lib.make_step(CFG, cfg, ptx, vtx, update_policy=True)
  new, m = fn(jax.tree.map(jnp.copy, step_lib.create_train_state(
      p, v, ptx, vtx, ref_params=ref)), batch)
  _, plain = fn(jax.tree.map(jnp.copy, step_lib.create_train_state(
      p, v, ptx, vtx)), batch)
  # k3 KL of the policy to the reference, GRPO's per-sequence token mean.
  mask = np.asarray(batch["action_mask"], np.float64)
  pol = np.asarray(logprobs_lib.token_logprobs(
      p, CFG, batch["tokens"], batch["attention_mask"], TEMP), np.float64)
  rf = np.asarray(logprobs_lib.token_logprobs(
      ref, CFG, batch["tokens"], batch["attention_mask"], TEMP), np.float64)
  k3 = np.exp(rf - pol) - (rf - pol) - 1.0
  want = np.mean((k3 * mask).sum(1) / mask.sum(1))
  assert float(m["policy/kl_ref_k3"]) == pytest.approx(want, rel=1e-4)
  assert float(m["policy/loss"]) == pytest.approx(
      float(plain["policy/loss"]) + 0.5 * want, rel=1e-4, abs=1e-6)
  assert "policy/kl_ref_k3" not in plain
  for a, b in zip(jax.tree.leaves(new.ref_params), jax.tree.leaves(ref)):
    np.testing.assert_array_equal(a, b)  # The reference stays frozen.
