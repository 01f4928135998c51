"""Chunked log-probs/entropy (`model.logits_chunk`) equal the full-logits path.

float32, within 1e-5 on log-probs, entropy, losses and gradients, on random
batches with padding and multi-turn action masks, chunk sizes that do not
divide the sequence, tied and untied heads; and compile-only memory that no
longer holds a [B, T, V] float32 array.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sao_jax import config_validation as cv
from sao_jax.models import logprobs as lp
from sao_jax.models import transformer
from sao_jax.models.config import ModelConfig
from sao_jax.train import sft
from sao_jax.train import step as step_lib

import tiny_models

# Compile-heavy (about 179 s as one Bazel target on 2 cores): //:fast_tests
# leaves it to the pytest run, which runs every test.
pytestmark = pytest.mark.slow

TOL = dict(rtol=1e-5, atol=1e-5)
TEMP = 0.7
B, T, V = 3, 29, 61  # T - 1 = 28: chunks of 5 or 6 positions leave a tail.


def _cfg(tie: bool, chunk: int = 0) -> ModelConfig:
  return tiny_models.tiny_model_config(vocab_size=V, tie_embeddings=tie,
                                       logits_chunk=chunk)


def _params(tie: bool):
  """Policy and critic params (the same whatever `logits_chunk`), made once
  per head layout by jitted programs."""
  return tiny_models.policy_and_critic(_cfg(tie))


def _batch(seed: int) -> dict[str, jax.Array]:
  """Random rows: right padding of random length, prompt, actions, an
  observation between two action turns, terminal 0/1 rewards."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, V, (B, T)).astype(np.int32)
  lengths = rng.integers(T // 2, T + 1, B)
  lengths[0] = T
  pos = np.arange(T)[None]
  attn = pos < lengths[:, None]
  tokens[~attn] = 0
  action = np.zeros((B, T), np.uint8)
  for r, n in enumerate(lengths):
    prompt, obs = rng.integers(2, 6), rng.integers(2, 5)
    turn = (n - prompt - obs) // 2
    action[r, prompt:prompt + turn] = 1
    action[r, prompt + turn + obs:n] = 1  # The second turn.
  rewards = np.zeros((B, T), np.float32)
  rewards[np.arange(B), lengths - 1] = rng.integers(0, 2, B)
  return {"tokens": jnp.asarray(tokens), "attention_mask": jnp.asarray(attn),
          "action_mask": jnp.asarray(action), "rewards": jnp.asarray(rewards),
          "prompt_id": jnp.arange(B), "group_index": jnp.asarray([0, 1, 0])}


def _close(a, b):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), **TOL)


def _tree_close(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    _close(x, y)


@pytest.mark.parametrize("layout", ["dv", "vd"])
@pytest.mark.parametrize("chunk", [1, 5, 6, 28, 100])
def test_chunked_head_equals_full_logits(layout, chunk):
  rng = np.random.default_rng(chunk)
  hidden = jnp.asarray(rng.standard_normal((B, T, 16)), jnp.float32)
  shape = (16, V) if layout == "dv" else (V, 16)
  weight = jnp.asarray(rng.standard_normal(shape), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
  cot = jnp.asarray(rng.standard_normal((2, B, T)), jnp.float32)

  def full(h, w):
    logits = jnp.einsum(f"btd,{layout}->btv", h, w)
    return lp.stats_from_logits(logits, tokens, TEMP, with_argmax=True)

  def chunked(h, w):
    return lp.chunked_token_stats(h, w, layout, tokens, chunk=chunk,
                                  temperature=TEMP, with_argmax=True)

  want, got = full(hidden, weight), chunked(hidden, weight)
  assert got["logp"].shape == (B, T) and float(jnp.abs(got["logp"][:, 0]).max()) == 0
  for k in ("logp", "entropy"):
    _close(got[k], want[k])
  np.testing.assert_array_equal(got["argmax"], want["argmax"])

  def loss(fn):
    return lambda h, w: ((fn(h, w)["logp"] * cot[0]).sum()
                         + (fn(h, w)["entropy"] * cot[1]).sum())
  _tree_close(jax.grad(loss(chunked), (0, 1))(hidden, weight),
              jax.grad(loss(full), (0, 1))(hidden, weight))


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("chunk", [15, 40])  # 5 or 13 positions per row.
def test_policy_token_stats_equal_full(tie, chunk):
  p, _ = _params(tie)
  batch = _batch(seed=int(tie))
  pos = transformer.positions_from_mask(batch["attention_mask"])

  def stats(params, c):
    return lp.policy_token_stats(params, _cfg(tie, c), batch["tokens"], pos,
                                 batch["attention_mask"], temperature=TEMP)
  want, got = stats(p, 0), stats(p, chunk)
  _close(got["logp"], want["logp"])
  _close(got["entropy"], want["entropy"])
  _close(lp.token_logprobs(p, _cfg(tie, chunk), batch["tokens"],
                           batch["attention_mask"], TEMP), want["logp"])
  mask = batch["action_mask"].astype(jnp.float32)
  loss = lambda params, c: (stats(params, c)["logp"] * mask).sum() / mask.sum()
  _tree_close(jax.grad(loss)(p, chunk), jax.grad(loss)(p, 0))


def _step(tie: bool, chunk: int, loss: str, seed: int, kl: bool):
  """One SAO/GRPO step with SGD(1): new params = old - gradient."""
  cfg = _cfg(tie, chunk)
  p, v = _params(tie)
  batch = _batch(seed)
  logp = lp.token_logprobs(p, _cfg(tie), batch["tokens"],
                           batch["attention_mask"], TEMP)
  noise = np.random.default_rng(seed).normal(0, 0.3, (B, T))
  batch["rollout_logp"] = (logp + noise) * batch["action_mask"]
  hp = (("kl_coef", 0.5),) if kl else ()
  scfg = step_lib.StepConfig(loss=loss, loss_hparams=hp,
                             critic_updates_per_step=1, temperature=TEMP,
                             max_groups=2)
  ptx, vtx = optax.sgd(1.0), optax.sgd(0.5)
  ref = jax.tree.map(lambda x: x * 0.9, p) if kl else None
  state = step_lib.create_train_state(p, v, ptx, vtx, ref_params=ref)
  fn = step_lib.make_step(cfg, scfg, ptx, vtx, update_policy=True)
  return fn(jax.tree.map(jnp.copy, state), batch)


@pytest.mark.parametrize("tie,loss,kl,seed", [
    (False, "sao", False, 0), (True, "sao", False, 1),
    (False, "grpo", True, 2), (True, "grpo", True, 3)])
def test_train_step_equals_full_logits(tie, loss, kl, seed):
  want_state, want = _step(tie, 0, loss, seed, kl)
  got_state, got = _step(tie, 24, loss, seed, kl)  # 8 positions per chunk.
  assert float(want["health/skipped"]) == 0
  assert float(want["policy/grad_norm"]) > 1e-3  # Gradients to compare.
  assert set(got) == set(want)
  for k in want:
    _close(got[k], want[k])
  # SGD(1): the updated params differ by the gradient difference.
  _tree_close(got_state.policy_params, want_state.policy_params)
  _tree_close(got_state.value_params, want_state.value_params)


@pytest.mark.parametrize("tie", [False, True])
def test_sft_loss_equals_full_logits(tie):
  p, _ = _params(tie)
  batch = _batch(seed=4)
  batch["loss_mask"] = batch["action_mask"].astype(jnp.float32)

  def nll(params, c):
    return sft.nll_loss(transformer.Transformer(_cfg(tie, c)), params, batch)
  (want, wm), wg = jax.value_and_grad(nll, has_aux=True)(p, 0)
  (got, gm), gg = jax.value_and_grad(nll, has_aux=True)(p, 9)
  _close(got, want)
  _close(gm["sft/token_accuracy"], wm["sft/token_accuracy"])
  _tree_close(gg, wg)
  # The reference NLL, written out from the logits.
  logits, _ = transformer.Transformer(_cfg(tie)).apply(
      {"params": p}, batch["tokens"],
      transformer.positions_from_mask(batch["attention_mask"]),
      batch["attention_mask"])
  ref = jax.nn.log_softmax(logits[:, :-1], -1)
  picked = jnp.take_along_axis(ref, batch["tokens"][:, 1:, None], -1)[..., 0]
  m = batch["loss_mask"][:, 1:]
  _close(got, -(picked * m).sum() / m.sum())


def _temp_bytes(chunk: int, batch: int, seq: int, vocab: int) -> int:
  """XLA temp bytes of the policy-gradient of a mean log-prob + entropy."""
  hidden = jax.ShapeDtypeStruct((batch, seq, 32), jnp.float32)
  weight = jax.ShapeDtypeStruct((32, vocab), jnp.float32)
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

  def loss(h, w, tok):
    if chunk:
      s = lp.chunked_token_stats(h, w, "dv", tok, chunk=chunk)
    else:
      s = lp.stats_from_logits(jnp.einsum("btd,dv->btv", h, w), tok)
    return s["logp"].mean() + 0.01 * s["entropy"].mean()
  compiled = jax.jit(jax.grad(loss, (0, 1))).lower(
      hidden, weight, tokens).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_chunked_memory_does_not_hold_the_logits():
  batch, seq, vocab, chunk = 2, 1024, 4096, 64
  logits_bytes = batch * seq * vocab * 4  # One [B, T, V] float32: 32 MiB.
  chunk_bytes = batch * chunk * vocab * 4  # One chunk's logits: 2 MiB.
  full = _temp_bytes(0, batch, seq, vocab)
  full_4x = _temp_bytes(0, batch, 4 * seq, vocab)
  assert full >= logits_bytes and full_4x - full >= 3 * logits_bytes
  # Measured 8.5 MiB at T = 1024: a few chunk-sized arrays, no [B, T, V].
  chunked = _temp_bytes(chunk, batch, seq, vocab)
  assert chunked < 6 * chunk_bytes < logits_bytes / 2
  # 4x the tokens: the growth is [B, T, D] activations (measured +1.6 MiB),
  # under a 16th of the full path's (+256 MiB).
  chunked_4x = _temp_bytes(chunk, batch, 4 * seq, vocab)
  assert chunked_4x - chunked < (full_4x - full) / 16


def test_logits_chunk_is_validated():
  with pytest.raises(ValueError, match="logits_chunk=-1: expected an int >= 0"):
    _cfg(False, -1)
  config = cv.base_config()
  config.model.logits_chunk = -2
  with pytest.raises(cv.ConfigError, match="config.model.logits_chunk"):
    cv.validate_config(config)
  with pytest.raises(ValueError, match="layout='bad'"):
    lp.chunked_token_stats(jnp.zeros((1, 3, 2)), jnp.zeros((2, 4)), "bad",
                           jnp.zeros((1, 3), jnp.int32), chunk=1)
  assert dataclasses.replace(_cfg(False), logits_chunk=64).same_architecture(
      _cfg(False))
