"""Scanned layers (stacked params, `nn.scan`) equal the unrolled reference.

float32, within 1e-5: logits, log-prob loss, value loss and their gradients on
padded batches; prefill + decode against the KV cache (shared and per-row
write ends); the layout conversions (models/layout.py) used by HF export and
orbax restore; and the compiled step holds one layer body whatever the depth.
"""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sao_jax import sharding
from sao_jax.models import hf
from sao_jax.models import layout
from sao_jax.models import transformer
from sao_jax.models.config import ModelConfig
from sao_jax.models.logprobs import token_logprobs
from sao_jax.train import checkpoint as ckpt_lib
from sao_jax.train import optim
from sao_jax.train import step as step_lib

# Compile-heavy (about 95 s as one Bazel target on 2 cores): //:fast_tests
# leaves it to the pytest run, which runs every test.
pytestmark = pytest.mark.slow

SCAN = ModelConfig.tiny(vocab_size=64, num_layers=3, qkv_bias=True)
UNROLLED = dataclasses.replace(SCAN, scan_layers=False)
ATOL = 1e-5


def _init(cfg, seed=0):
  tok = jnp.zeros((1, 4), jnp.int32)
  params = nn.unbox(transformer.Transformer(cfg).init(
      jax.random.PRNGKey(seed), tok, tok, tok > -1)["params"])
  # Larger weights: distributions far from uniform, differences visible.
  return jax.tree.map(lambda a: a * 4.0 if a.ndim > 1 else a + 0.1, params)


@pytest.fixture(scope="module")
def params():
  unrolled = _init(UNROLLED)
  return unrolled, layout.stack_layers(unrolled)


def _batch(b=4, t=11, seed=1):
  """Random tokens; rows right-padded, left-padded and padded in the middle."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, SCAN.vocab_size, (b, t)).astype(np.int32)
  mask = np.ones((b, t), bool)
  mask[0, 7:] = False
  mask[1, :3] = False
  mask[2, 4:6] = False
  return jnp.asarray(tokens), jnp.asarray(mask)


def _close(a, b, atol=ATOL, to_scale=False):
  """Each leaf of `a` within `atol` of `b`'s; with `to_scale`, within `atol`
  times the leaf's largest magnitude (at least 1).

  Losses and gradients of the 4x-scaled model reach 10-40 (a value loss 1e4):
  the scanned and unrolled programs sum in different orders, so float32
  rounding alone moves them by a few 1e-7 of their size (1.1e-5 at 25.4 in
  CI), past an absolute 1e-5.
  """
  def check(x, y):
    x, y = np.asarray(x), np.asarray(y)
    scale = max(1.0, float(np.abs(y).max())) if to_scale else 1.0
    np.testing.assert_allclose(x, y, atol=atol * scale, rtol=0)
  jax.tree.map(check, a, b)


def test_stacked_params_have_a_leading_layers_axis(params):
  unrolled, stacked = params
  init = _init(SCAN)
  assert jax.tree.structure(init) == jax.tree.structure(stacked)
  fresh = init["decoder"]["layers"]["mlp"]["up_proj"]
  assert not np.allclose(fresh[0], fresh[1])  # Each layer its own init.
  q = stacked["decoder"]["layers"]["attn"]["q_proj"]
  assert q.shape == (3, 64, 4, 16)
  np.testing.assert_array_equal(
      q[2], unrolled["decoder"]["layers_2"]["attn"]["q_proj"])
  boxed = transformer.Transformer(SCAN).init(
      jax.random.PRNGKey(0), *(jnp.zeros((1, 2), jnp.int32),) * 2,
      jnp.ones((1, 2), bool))["params"]
  names = boxed["decoder"]["layers"]["mlp"]["down_proj"].names
  assert names == ("layers", "mlp", "embed")
  # The default rules never split the layer axis.
  mesh = jax.make_mesh((1, 1, 1), sharding.MESH_AXES)
  spec = sharding.logical_to_spec(names, (3, 128, 64), mesh)
  assert spec == jax.sharding.PartitionSpec(None, "tensor", "fsdp")


def test_logits_loss_and_gradients_match_unrolled(params):
  unrolled, stacked = params
  tokens, mask = _batch()
  pos = transformer.positions_from_mask(mask)
  logits = [transformer.Transformer(c).apply({"params": p}, tokens, pos, mask)[0]
            for c, p in ((UNROLLED, unrolled), (SCAN, stacked))]
  assert float(jnp.abs(logits[0]).max()) > 1.0  # Not a trivial model.
  _close(logits[0], logits[1])

  def loss(p, cfg):
    lp = token_logprobs(p, cfg, tokens, mask, 0.7)
    return -(lp * mask).sum() / mask.sum()

  (l_u, g_u), (l_s, g_s) = (jax.value_and_grad(loss)(p, c) for p, c in (
      (unrolled, UNROLLED), (stacked, SCAN)))
  _close(l_u, l_s, to_scale=True)
  assert float(optax.global_norm(g_s)) > 1e-3
  _close(layout.stack_layers(g_u), g_s, to_scale=True)


def test_value_model_and_its_gradients_match_unrolled(params):
  unrolled, stacked = params
  tokens, mask = _batch(seed=2)
  pos = transformer.positions_from_mask(mask)
  v_u = transformer.value_params_from_policy(unrolled, UNROLLED,
                                             jax.random.PRNGKey(3))
  v_s = transformer.value_params_from_policy(stacked, SCAN,
                                             jax.random.PRNGKey(3))
  assert "layers" in v_s["decoder"] and "layers_0" in v_u["decoder"]

  def loss(p, cfg):
    v = transformer.ValueModel(cfg).apply({"params": p}, tokens, pos, mask)
    return ((v - 0.5) ** 2 * mask).sum(), v

  (l_u, val_u), g_u = jax.value_and_grad(loss, has_aux=True)(v_u, UNROLLED)
  (l_s, val_s), g_s = jax.value_and_grad(loss, has_aux=True)(v_s, SCAN)
  _close(val_u, val_s, to_scale=True)
  _close(l_u, l_s, to_scale=True)
  _close(layout.stack_layers(g_u), g_s, to_scale=True)


@pytest.mark.parametrize("per_row", [False, True])
def test_prefill_and_decode_with_the_cache_match_unrolled(params, per_row):
  unrolled, stacked = params
  tokens, mask = _batch(b=3, t=6, seed=4)
  mask = mask.at[0, 4:].set(True)  # Prompts left/mid padded, real last token.
  dec = np.random.default_rng(5).integers(0, 64, (3, 3)).astype(np.int32)
  out = {}
  for name, cfg, p in (("u", UNROLLED, unrolled), ("s", SCAN, stacked)):
    model = transformer.Transformer(cfg)
    cache = transformer.init_cache(cfg, 3, 12, per_row=per_row)
    pos = transformer.positions_from_mask(mask)
    logits, cache = model.apply({"params": p}, tokens, pos, mask, cache)
    steps = [logits]
    nxt = pos[:, -1:]
    for i in range(3):
      tok = jnp.asarray(dec[:, i:i + 1])
      nxt = nxt + 1
      logits, cache = model.apply({"params": p}, tok, nxt,
                                  jnp.ones((3, 1), bool), cache)
      steps.append(logits)
    out[name] = (steps, cache)
  _close(out["u"][0], out["s"][0])
  _close((out["u"][1].k, out["u"][1].v), (out["s"][1].k, out["s"][1].v))
  assert out["s"][1].k.shape == (3, 3, 12, 2, 16)
  # Decoding with the cache equals a full forward of the same tokens.
  full = jnp.concatenate([tokens, jnp.asarray(dec)], 1)
  full_mask = jnp.concatenate([mask, jnp.ones((3, 3), bool)], 1)
  ref, _ = transformer.Transformer(SCAN).apply(
      {"params": stacked}, full, transformer.positions_from_mask(full_mask),
      full_mask)
  _close(ref[:, -4:], jnp.concatenate(
      [out["s"][0][0][:, -1:]] + [x for x in out["s"][0][1:]], 1), atol=1e-4)


def _dot_count(cfg):
  """dot_generals in the lowered SAO-style grad of the log-prob loss
  (lowered only: the params' shapes are all it needs)."""
  p = jax.eval_shape(lambda: _init(cfg))
  tokens, mask = _batch()
  fn = jax.jit(jax.grad(lambda p: token_logprobs(p, cfg, tokens, mask).sum()))
  return len(re.findall(r"dot_general", fn.lower(p).as_text()))


def test_one_layer_body_whatever_the_depth():
  deep = dataclasses.replace(SCAN, num_layers=8)
  assert _dot_count(SCAN) == _dot_count(deep)
  unrolled = [_dot_count(dataclasses.replace(c, scan_layers=False))
              for c in (SCAN, deep)]
  assert unrolled[1] > 2 * unrolled[0]  # The reference grows with depth.


def test_layout_round_trip_on_boxed_abstract_and_optimizer_trees(params):
  unrolled, stacked = params
  _close(layout.unstack_layers(stacked), unrolled)
  assert layout.layouts(stacked) == {"stacked"}
  assert layout.layouts(unrolled) == {"per_layer"}
  tx = optim.make_optimizer(1e-3, labels=optim.frozen_attention_labels(
      stacked))
  opt = tx.init(stacked)
  _close(layout.stack_layers(layout.unstack_layers(opt)), opt)
  mesh = jax.make_mesh((1, 1, 1), sharding.MESH_AXES)
  abstract = jax.eval_shape(lambda: transformer.Transformer(SCAN).init(
      jax.random.PRNGKey(0), *(jnp.zeros((1, 2), jnp.int32),) * 2,
      jnp.ones((1, 2), bool)))["params"]
  shard = sharding.param_shardings(abstract, mesh)
  structs = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
      nn.unbox(abstract), shard)
  per_layer = layout.unstack_layers(structs)
  gate = per_layer["decoder"]["layers_1"]["mlp"]["gate_proj"]
  assert gate.shape == (64, 128)
  assert tuple(gate.sharding.spec) == tuple(
      shard["decoder"]["layers"]["mlp"]["gate_proj"].spec)[1:]
  back = layout.stack_layers(per_layer)
  assert jax.tree.map(lambda s: s.shape, back) == jax.tree.map(
      lambda s: s.shape, structs)
  with pytest.raises(ValueError, match="not layers_0"):
    layout.stack_layers({"layers_0": 1, "layers_2": 2})


def test_hf_export_is_layout_free_and_loads_either_layout(params, tmp_path):
  unrolled, stacked = params
  hf.save_hf_checkpoint(SCAN, stacked, tmp_path / "s", "Qwen2ForCausalLM")
  hf.save_hf_checkpoint(SCAN, unrolled, tmp_path / "u", "Qwen2ForCausalLM")
  assert (tmp_path / "s" / hf.WEIGHTS_FILE).read_bytes() == (
      tmp_path / "u" / hf.WEIGHTS_FILE).read_bytes()
  cfg, loaded = hf.load_hf_checkpoint(tmp_path / "s")
  assert cfg.scan_layers and cfg.same_architecture(SCAN)
  _close(loaded, stacked, atol=0)
  cfg, loaded = hf.load_hf_checkpoint(tmp_path / "s", scan_layers=False)
  assert not cfg.scan_layers
  _close(loaded, unrolled, atol=0)
  with pytest.raises(hf.CheckpointError, match="leading axis of 3"):
    short = {**stacked, "decoder": {**stacked["decoder"], "layers": jax.tree.map(
        lambda x: x[:2], stacked["decoder"]["layers"])}}
    hf.save_hf_checkpoint(SCAN, short, tmp_path / "bad", "Qwen2ForCausalLM")


def _state(policy, cfg):
  value = transformer.value_params_from_policy(policy, cfg,
                                               jax.random.PRNGKey(1))
  tx = optim.make_optimizer(1e-3)
  vtx = optim.make_optimizer(1e-3, labels=optim.frozen_attention_labels(
      value))
  state = step_lib.create_train_state(policy, value, tx, vtx)
  # Nonzero moments, so a mix-up of layers would show.
  return jax.tree.map(lambda x: x + 0.25 if jnp.issubdtype(
      x.dtype, jnp.floating) else x, state)


@pytest.mark.parametrize("saved_scan", [False, True])
def test_checkpoint_of_the_other_layout_is_converted(params, tmp_path,
                                                     saved_scan):
  unrolled, stacked = params
  old, new = ((stacked, unrolled) if saved_scan else (unrolled, stacked))
  saved = _state(old, SCAN if saved_scan else UNROLLED)
  want = _state(new, UNROLLED if saved_scan else SCAN)
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / "ckpt"))
  assert ckpt.save(3, saved, {"episodes_consumed": 7})
  got, meta, step = ckpt.restore(want)
  assert (step, meta["episodes_consumed"]) == (3, 7)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  _close(got, want, atol=0)
  ckpt.close()


def test_checkpoint_with_other_depth_is_refused_with_what_to_do(tmp_path):
  saved = _state(_init(dataclasses.replace(UNROLLED, num_layers=2)),
                 UNROLLED)
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / "ckpt"))
  assert ckpt.save(1, saved, {})
  with pytest.raises(ckpt_lib.CheckpointError,
                     match="different model/optimizer config; delete it or "
                     "use the matching config"):
    ckpt.restore(_state(_init(SCAN), SCAN))
  ckpt.close()
