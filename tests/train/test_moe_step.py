"""The SAO step on a mixture-of-experts policy: routing replay (R3), its
metrics and the router's load-balancing loss (train/step.py).

The problem (params, batch, the router's own choice) is built once per
config and shared; its init and forwards are jitted (one compile each, not
op-by-op dispatch).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.models import logprobs as logprobs_lib
from sao_jax.models import transformer
from sao_jax.models.config import ModelConfig
from sao_jax.models.config import MoeConfig
from sao_jax.train import optim
from sao_jax.train import step as step_lib

import tiny_models

# Compile-heavy (about 88 s as one Bazel target on 2 cores): //:fast_tests
# leaves it to the pytest run, which runs every test.
pytestmark = pytest.mark.slow

E, K = 8, 2


def _cfg(chunk: int) -> ModelConfig:
  return tiny_models.tiny_model_config(
      vocab_size=64, intermediate_size=48, logits_chunk=chunk,
      moe=MoeConfig(num_experts=E, top_k=K, intermediate_size=16))


@functools.cache
def _problem(cfg):
  """(params, batch, the un-replayed forward's stats), once per config."""
  tok = jnp.zeros((1, 4), jnp.int32)
  params = jax.jit(lambda k: nn.unbox(transformer.Transformer(cfg).init(
      k, tok, tok, tok > -1)["params"]))(jax.random.PRNGKey(0))
  stats = jax.jit(functools.partial(logprobs_lib.policy_token_stats,
                                    config=cfg))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 64, (3, 12)).astype(np.int32)
  attn = np.ones((3, 12), bool)
  attn[1, 9:] = False  # Right padding.
  action = np.zeros((3, 12), np.uint8)
  action[:, 4:9] = 1
  action[2, 6:8] = 0  # A multi-turn observation inside the actions.
  positions = transformer.positions_from_mask(jnp.asarray(attn))
  own = stats(params, tokens=tokens, positions=positions, attention_mask=attn)
  # The sampler routed every token elsewhere (another kernel, dtype or
  # batch shape); its log-probs are those of the experts it used.
  recorded = (own["moe_experts"] + 1) % E
  sampled = stats(params, tokens=tokens, positions=positions,
                  attention_mask=attn, routing=recorded)
  batch = {"tokens": tokens, "attention_mask": attn, "action_mask": action,
           "rewards": np.eye(12, dtype=np.float32)[[8, 8, 8]],
           "rollout_logp": np.asarray(sampled["logp"]) * action,
           "routed_experts": np.asarray(recorded)}
  return params, jax.tree.map(jnp.asarray, batch), own


@pytest.mark.parametrize("chunk", [0, 5])
def test_replay_reproduces_the_samplers_logprobs(chunk):
  cfg = _cfg(chunk)
  params, batch, own = _problem(cfg)
  policy = transformer.Transformer(cfg)
  act = np.asarray(batch["action_mask"], bool)
  logp = jax.jit(functools.partial(step_lib._policy_logp, policy,
                                   temperature=1.0),
                 static_argnames="replay")
  replayed, _, moe = logp(params, batch, replay=True)
  np.testing.assert_allclose(np.asarray(replayed)[act],
                             np.asarray(batch["rollout_logp"])[act], atol=1e-5)
  own_logp, _, _ = logp(params, batch)
  assert np.abs(np.asarray(own_logp)[act] -
                np.asarray(batch["rollout_logp"])[act]).max() > 1e-3
  # Under replay the router's own choice is still reported: in the first MoE
  # layer it is what the un-replayed forward picks (later layers see hidden
  # states computed with the replayed experts).
  np.testing.assert_array_equal(moe["moe_own_experts"][:, :, 0],
                                own["moe_experts"][:, :, 0])


def _step(cfg, replay: bool, coef: float):
  params, batch, _ = _problem(cfg)
  params = jax.tree.map(jnp.copy, params)  # The step donates its state.
  value = transformer.value_params_from_policy(params, cfg,
                                               jax.random.PRNGKey(1))
  tx = optim.make_optimizer(1e-3)
  state = step_lib.create_train_state(params, value, tx, tx)
  step = step_lib.make_step(
      cfg, step_lib.StepConfig(loss="sao", routing_replay=replay,
                               router_aux_loss_coef=coef), tx, tx,
      update_policy=True)
  return jax.device_get(step(state, batch)[1])


def test_step_metrics_and_aux_loss():
  cfg = _cfg(0)
  replay = _step(cfg, replay=True, coef=0.0)
  off = _step(cfg, replay=False, coef=0.0)
  weighted = _step(cfg, replay=True, coef=0.5)
  # Every recorded expert set differs from the router's own choice.
  assert replay["policy/routing_agreement"] == 0.0
  assert off["policy/routing_agreement"] == 0.0
  # Replay removes the mismatch DIS would have to mask; without it, the
  # trainer's log-probs are off and DIS rejects tokens.
  assert replay["policy/logp_abs_diff"] < 1e-5
  assert off["policy/logp_abs_diff"] > 1e-3
  assert replay["policy/accept_frac"] == 1.0
  aux = replay["policy/moe_aux_loss"]
  assert aux > 1.0  # E * sum f * P is k = 2 when balanced, more when not.
  np.testing.assert_allclose(weighted["policy/loss"] - replay["policy/loss"],
                             0.5 * aux, rtol=1e-4)
