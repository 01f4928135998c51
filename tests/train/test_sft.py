"""Tests for the supervised warm start."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.models import transformer
from sao_jax.train import sft

import tiny_models

CFG = tiny_models.tiny_model_config()


def _init(rng=0):
  model = transformer.Transformer(CFG)
  tok = jnp.zeros((1, 4), jnp.int32)
  params = model.init(jax.random.PRNGKey(rng), tok, tok, tok > -1)["params"]
  return model, nn.unbox(params)


def test_encode_example_masks_only_completion():
  ex = sft.encode_example([5, 6, 7], [8, 9], max_len=8)
  np.testing.assert_array_equal(ex["tokens"], [5, 6, 7, 8, 9, 0, 0, 0])
  np.testing.assert_array_equal(ex["attention_mask"], [1, 1, 1, 1, 1, 0, 0, 0])
  np.testing.assert_array_equal(ex["loss_mask"], [0, 0, 0, 1, 1, 0, 0, 0])
  with pytest.raises(ValueError, match="exceeds max_len=4"):
    sft.encode_example([1, 2, 3], [4, 5], max_len=4)
  # Multi-turn: an observation between two actions is not trained on.
  ex = sft.encode_segments([([5, 6], False), ([7], True), ([8, 9], False),
                            ([10, 11], True)], max_len=8)
  np.testing.assert_array_equal(ex["tokens"], [5, 6, 7, 8, 9, 10, 11, 0])
  np.testing.assert_array_equal(ex["loss_mask"], [0, 0, 1, 0, 0, 1, 1, 0])


def test_nll_matches_numpy():
  model, params = _init()
  batch = {k: jnp.asarray(np.stack([v, v2])) for (k, v), v2 in zip(
      sft.encode_example([3, 4, 5], [6, 7], 6).items(),
      sft.encode_example([9, 10], [11, 12, 13], 6).values())}
  loss, _ = sft.nll_loss(model, params, batch)
  logits, _ = model.apply(
      {"params": params}, batch["tokens"],
      transformer.positions_from_mask(batch["attention_mask"]),
      batch["attention_mask"])
  logits = np.asarray(logits, np.float64)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  terms = []
  for b, (start, end) in enumerate([(3, 5), (2, 5)]):
    for t in range(start, end):  # token t predicted from position t-1.
      terms.append(-logp[b, t - 1, int(batch["tokens"][b, t])])
  assert float(loss) == pytest.approx(np.mean(terms), rel=1e-5)


def test_sft_memorises_small_set():
  _, params = _init(1)
  rng = np.random.default_rng(0)
  examples = [[(list(rng.integers(4, 32, 5)), False),
               (list(rng.integers(4, 32, 3)), True)] for _ in range(8)]
  cfg = sft.SFTConfig(steps=150, batch_size=8, max_len=10, lr=1e-2,
                      warmup_steps=10, log_every=50, log_every_s=0)
  seen = []
  _, metrics = sft.run_sft(CFG, params, examples, cfg,
                           on_metrics=lambda i, m: seen.append((i, m)))
  assert [i for i, _ in seen] == [50, 100, 150]
  assert seen[0][1]["sft/loss"] > metrics["sft/loss"]
  assert metrics["sft/loss"] < 0.1
  assert metrics["sft/token_accuracy"] == 1.0


def test_sft_logs_slow_steps_by_time():
  """With ``log_every_s`` shorter than a step, every step is logged."""
  _, params = _init(1)
  examples = [[([5, 6, 7], False), ([8, 9], True)]] * 4
  cfg = sft.SFTConfig(steps=4, batch_size=4, max_len=6, log_every=50,
                      log_every_s=1e-9)
  seen = []
  sft.run_sft(CFG, params, examples, cfg,
              on_metrics=lambda i, m: seen.append(i))
  assert seen == [1, 2, 3, 4]


def test_sft_time_logs_follow_the_device_not_dispatch(monkeypatch):
  """Steps that take ~0.3 s on the device: a time-based log comes before
  the last step (JAX's async dispatch must not let the loop run ahead)."""
  real_make = sft.make_sft_step

  @jax.jit
  def sleeper(loss):  # ~0.3 s of device work (not a host callback: those
    # run synchronously and would hide the run-ahead).
    a = jnp.full((1000, 1000), 1e-3) * loss
    a = jax.lax.fori_loop(0, 20, lambda _, a: jnp.tanh(a @ a), a)
    return loss + 0.0 * a[0, 0]

  def slow_make(model_config, tx):
    real = real_make(model_config, tx)

    def step(params, opt_state, batch):
      params, opt_state, m = real(params, opt_state, batch)
      return params, opt_state, {**m, "sft/loss": sleeper(m["sft/loss"])}
    return step

  monkeypatch.setattr(sft, "make_sft_step", slow_make)
  _, params = _init(1)
  examples = [[([5, 6, 7], False), ([8, 9], True)]] * 4
  cfg = sft.SFTConfig(steps=8, batch_size=4, max_len=6, log_every=50,
                      log_every_s=0.5)
  seen = []
  sft.run_sft(CFG, params, examples, cfg,
              on_metrics=lambda i, m: seen.append(i))
  assert seen[-1] == 8
  # Step 1 logs anyway (its compile takes more than 0.5 s).
  assert any(1 < i < 8 for i in seen), seen
