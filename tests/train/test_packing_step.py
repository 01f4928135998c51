"""The SAO train step on packed rows equals it on unpacked rows (float32).

The same trajectories, one per row (the reference) or packed several to a
row with segment ids (``sao_jax.data.packing``): the trainer's log-probs,
the critic's aligned values, the step's losses and every parameter's
gradient agree within 1e-5, and a packed trajectory's log-probs and values
do not change when its row neighbours do.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import packing_inputs as pi
from sao_jax.models import transformer
from sao_jax.train import step as step_lib

import tiny_models

CFG = tiny_models.tiny_model_config(attention="dense")
TEMP = 0.8


def _params():
  """Policy and critic params of CFG (the attention path changes none of
  them), made once per process."""
  return tiny_models.policy_and_critic(CFG)


def _layouts(cfg, params, seed=0):
  """(unpacked, packed) batches of the same trajectories, whose rollout
  log-probs are the policy's own plus noise (ratios near 1)."""
  trajs = pi.trajs(seed, n=11)
  un = {k: jnp.asarray(v) for k, v in pi.unpacked(trajs, 16).items()}
  logp, _, _ = step_lib._policy_logp(
      transformer.Transformer(cfg), params, un, TEMP)
  rng = np.random.default_rng(seed + 7)
  for i, t in enumerate(trajs):
    noise = rng.normal(0.0, 0.2, t.length).astype(np.float32)
    t.rollout_logp = np.where(t.action_mask > 0,
                              np.asarray(logp[i, :t.length]) + noise, 0.0)
  un = {k: jnp.asarray(v) for k, v in pi.unpacked(trajs, 16).items()}
  (pk,), _ = pi.packed(trajs, batch_size=3, seq_len=48, max_segments=6)
  assert pk["length"].min() == 0 and (pk["length"] > 0).sum(1).max() >= 3
  return un, {k: jnp.asarray(v) for k, v in pk.items()}


@pytest.mark.parametrize("attention", ["dense", "blockwise"])
def test_logprobs_and_values_packed_equal_unpacked(attention):
  cfg = dataclasses.replace(CFG, attention=attention, attention_block_q=8,
                            attention_block_kv=8)
  p, v = _params()
  un, pk = _layouts(cfg, p)
  policy, critic = transformer.Transformer(cfg), transformer.ValueModel(cfg)
  for fn, params, args in ((step_lib._policy_logp, p, (TEMP,)),
                           (step_lib._aligned_values, v, ())):
    model = policy if fn is step_lib._policy_logp else critic
    out_un = fn(model, params, un, *args)
    out_pk = fn(model, params, pk, *args)
    # (log-probs, entropy[, a MoE policy's routing]) or the values.
    for a, b in zip(*(o[:2] if isinstance(o, tuple) else (o,)
                      for o in (out_un, out_pk))):
      pi.same_per_trajectory(a, un, b, pk)


@pytest.mark.parametrize("loss", ["sao", "ppo"])
def test_train_step_losses_and_gradients_packed_equal_unpacked(loss):
  p, v = _params()
  un, pk = _layouts(CFG, p, seed=1)
  cfg = step_lib.StepConfig(loss=loss, critic_updates_per_step=1,
                            temperature=TEMP, gamma=0.99, max_groups=66)
  tx = optax.sgd(1.0)  # new = old − grad: the update is the gradient.
  fn = step_lib.make_step(CFG, cfg, tx, tx, update_policy=True)
  results = {}
  for name, batch in (("un", un), ("pk", pk)):
    state = step_lib.create_train_state(p, v, tx, tx)
    new, metrics = fn(jax.tree.map(jnp.copy, state), batch)
    grads = jax.tree.map(lambda a, b: a - b, (p, v),
                         (new.policy_params, new.value_params))
    results[name] = (jax.device_get(metrics), grads)
  mu, mp = results["un"][0], results["pk"][0]
  assert mu["health/skipped"] == mp["health/skipped"] == 0.0
  for key in ("policy/loss", "critic/loss", "reward/mean", "advantage/mean",
              "returns/mean", "tokens/action", "policy/entropy"):
    np.testing.assert_allclose(mu[key], mp[key], atol=1e-5, rtol=1e-5,
                               err_msg=key)
  assert mu["batch/trajectories"] == mp["batch/trajectories"] == 11
  assert mp["batch/padding_frac"] < mu["batch/padding_frac"]
  gu, gp = results["un"][1], results["pk"][1]
  flat_u, flat_p = jax.tree.leaves(gu), jax.tree.leaves(gp)
  assert sum(float(jnp.abs(g).sum()) for g in flat_u) > 1e-3
  for a, b in zip(flat_u, flat_p):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_nothing_leaks_across_segments_in_the_models():
  p, v = _params()
  _, pk = _layouts(CFG, p, seed=2)
  victim = (pk["segment_ids"] == 2) & (jnp.arange(3) == 0)[:, None]
  other = pk["attention_mask"] & ~victim
  changed = dict(pk, tokens=jnp.where(victim, 3, pk["tokens"]))
  policy, critic = transformer.Transformer(CFG), transformer.ValueModel(CFG)
  lp0, _, _ = step_lib._policy_logp(policy, p, pk, TEMP)
  lp1, _, _ = step_lib._policy_logp(policy, p, changed, TEMP)
  v0 = step_lib._aligned_values(critic, v, pk)
  v1 = step_lib._aligned_values(critic, v, changed)
  np.testing.assert_allclose(lp0[other], lp1[other], atol=1e-6)
  np.testing.assert_allclose(v0[other], v1[other], atol=1e-6)
  assert not np.allclose(lp0[victim], lp1[victim])
  # The value read for the first token of a trajectory is never the last
  # token of the previous one: 0, as at t = 0 of an unpacked row.
  starts = (pk["segment_ids"] > 0) & (pk["positions"] == 0)
  assert float(jnp.abs(v0[starts]).max()) == 0.0
