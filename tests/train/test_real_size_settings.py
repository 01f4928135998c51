"""Real-size run settings: remat policies, bf16 compute over float32 master
weights."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.models import logprobs as logprobs_lib
from sao_jax.models import transformer
from sao_jax.models.config import ModelConfig
from sao_jax.train import optim
from sao_jax.train import step as step_lib

import tiny_models

# Compile-heavy (about 72 s as one Bazel target on 2 cores): //:fast_tests
# leaves it to the pytest run, which runs every test.
pytestmark = pytest.mark.slow

CFG = ModelConfig.tiny(vocab_size=64)


def _policy(cfg):
  tok = jnp.zeros((1, 4), jnp.int32)
  return tiny_models.init_params(transformer.Transformer(cfg),
                                 jax.random.PRNGKey(0), tok, tok,
                                 tok > -1)["params"]


def _data():
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, 64, (2, 10)).astype(np.int32))
  return tokens, jnp.ones((2, 10), bool)


def _loss(cfg, params, tokens, mask):
  return -logprobs_lib.token_logprobs(params, cfg, tokens, mask).mean()


@functools.cache
def _without_remat(scan: bool):
  """(config, params, gradient) without remat: the reference of the three
  policies' cases, computed once per layout."""
  base = dataclasses.replace(CFG, scan_layers=scan)
  params = _policy(base)
  tokens, mask = _data()
  return base, params, jax.grad(lambda p: _loss(base, p, tokens, mask))(params)


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.parametrize("policy", ["full", "dots_saveable",
                                    "dots_with_no_batch_dims_saveable"])
def test_remat_recomputes_and_gives_the_same_gradients(policy, scan):
  base, params, base_grads = _without_remat(scan)
  tokens, mask = _data()
  remat = dataclasses.replace(base, remat_policy=policy)
  assert jax.tree.structure(jax.eval_shape(lambda: _policy(remat))) == (
      jax.tree.structure(params))
  grads = [base_grads,
           jax.grad(lambda p: _loss(remat, p, tokens, mask))(params)]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
               *grads)
  text = [str(jax.make_jaxpr(jax.grad(lambda p, c=c: _loss(c, p, tokens,
                                                            mask)))(params))
          for c in (base, remat)]
  assert "remat" not in text[0] and "checkpoint" not in text[0]
  assert "remat" in text[1] or "checkpoint" in text[1]
  forward = str(jax.make_jaxpr(lambda p: _loss(remat, p, tokens, mask))(
      params))  # The policy reaches jax.checkpoint.
  assert f"policy={transformer.remat_policy(policy)}" in forward


def test_unknown_remat_policy_is_refused():
  with pytest.raises(ValueError, match="remat_policy='dots': expected one of"):
    dataclasses.replace(CFG, remat_policy="dots")


def test_bf16_compute_keeps_float32_master_params_and_moments():
  cfg = dataclasses.replace(CFG, dtype="bfloat16", remat_policy="full")
  params = _policy(cfg)
  value = transformer.value_params_from_policy(params, cfg,
                                               jax.random.PRNGKey(1))
  tx = optim.make_optimizer(1e-3)
  state = step_lib.create_train_state(params, value, tx, tx)
  for leaf in jax.tree.leaves((state.policy_params, state.value_params,
                               state.policy_opt_state, state.value_opt_state)):
    if jnp.issubdtype(leaf.dtype, jnp.floating):
      assert leaf.dtype == jnp.float32
  tokens, mask = _data()
  logits, _ = transformer.Transformer(cfg).apply(
      {"params": params}, tokens, transformer.positions_from_mask(mask), mask)
  assert logits.dtype == jnp.float32
  ref, _ = transformer.Transformer(CFG).apply(
      {"params": params}, tokens, transformer.positions_from_mask(mask), mask)
  err = float(jnp.abs(logits - ref).max())
  assert 0 < err < 0.1  # bf16 rounding, not a different model.
  grads = jax.grad(lambda p: _loss(cfg, p, tokens, mask))(params)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


def test_same_architecture_ignores_run_settings():
  a = ModelConfig.tiny()
  assert a.same_architecture(dataclasses.replace(
      a, dtype="bfloat16", param_dtype="bfloat16", remat_policy="full"))
  assert not a.same_architecture(dataclasses.replace(a, num_layers=3))
