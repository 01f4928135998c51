"""Tests for sao_jax.models: KV cache, padding, value model, logical axes."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.models import transformer as tm
from sao_jax.models.layers import rope
from sao_jax.models.config import ModelConfig
from sao_jax.models.config import UnsupportedConfigError

import tiny_models

B, T = 3, 12


@pytest.fixture(scope="module")
def setup():
  cfg = ModelConfig.tiny(vocab_size=97, qkv_bias=True, rope_theta=500.0)
  model = tm.Transformer(cfg)
  tokens = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)
  # Row 0: no padding; row 1: 3 left pads; row 2: 5 left pads + a hole at 8
  # (an invalid slot in the middle, e.g. a dropped observation token).
  mask = np.ones((B, T), bool)
  mask[1, :3] = False
  mask[2, :5] = False
  mask[2, 8] = False
  mask = jnp.asarray(mask)
  positions = tm.positions_from_mask(mask)
  variables = tiny_models.init_params(model, jax.random.key(0), tokens,
                                      positions, mask, unbox=False)
  params = nn.unbox(variables)
  full, _ = jax.jit(model.apply)(params, tokens, positions, mask)
  return cfg, model, variables, params, tokens, mask, positions, full


def _close_on_real(got, want, mask, atol):
  m = np.asarray(mask)
  np.testing.assert_allclose(np.asarray(got)[m], np.asarray(want)[m], atol=atol,
                             rtol=0)


def test_positions_from_mask():
  mask = jnp.array([[0, 0, 1, 1, 1], [1, 1, 0, 1, 1]])
  np.testing.assert_array_equal(
      tm.positions_from_mask(mask), [[0, 0, 0, 1, 2], [0, 1, 1, 2, 3]])


def test_prefill_then_token_by_token_decode_equals_full_forward(setup):
  cfg, model, _, params, tokens, mask, positions, full = setup
  apply = jax.jit(model.apply)
  prefill = 6
  cache = tm.init_cache(cfg, B, 16)
  logits, cache = apply(params, tokens[:, :prefill], positions[:, :prefill],
                        mask[:, :prefill], cache)
  steps = [logits]
  for t in range(prefill, T):
    sl = slice(t, t + 1)
    logits, cache = apply(params, tokens[:, sl], positions[:, sl], mask[:, sl],
                          cache)
    steps.append(logits)
  assert int(cache.end) == T
  np.testing.assert_array_equal(cache.valid[:, :T], mask)
  assert not cache.valid[:, T:].any()
  # All positions, padding included (padding queries attend only to themselves).
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-5,
                             rtol=0)
  # The check is not vacuous: logits differ across positions.
  assert float(jnp.abs(full[0, 3] - full[0, 2]).max()) > 1e-3


def test_multi_token_chunk_mid_sequence_equals_full_forward(setup):
  cfg, model, _, params, tokens, mask, positions, full = setup
  cache = tm.init_cache(cfg, B, T)  # Exactly full at the end.
  apply = jax.jit(model.apply)
  outs = []
  for lo, hi in [(0, 4), (4, 9), (9, 10), (10, T)]:  # Chunks with end>0, T>1.
    logits, cache = apply(params, tokens[:, lo:hi], positions[:, lo:hi],
                                mask[:, lo:hi], cache)
    outs.append(logits)
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=1e-5,
                             rtol=0)


def test_left_padding_does_not_change_real_logits(setup):
  cfg, model, _, params, tokens, mask, positions, full = setup
  # Row 1 has 3 left pads: unpadded on its own it must give the same logits.
  row = tokens[1:2, 3:]
  ones = jnp.ones_like(row, bool)
  apply = jax.jit(model.apply)  # One compile per shape; op by op costs more.
  alone, _ = apply(params, row, tm.positions_from_mask(ones), ones)
  np.testing.assert_allclose(alone[0], full[1, 3:], atol=1e-5, rtol=0)
  # Pad token ids are irrelevant to real positions.
  other = jnp.where(mask, tokens, (tokens + 7) % cfg.vocab_size)
  again, _ = apply(params, other, positions, mask)
  _close_on_real(again, full, mask, 1e-6)


def test_causality(setup):
  _, model, _, params, tokens, mask, positions, full = setup
  changed = tokens.at[:, -1].set((tokens[:, -1] + 1) % 97)
  logits, _ = jax.jit(model.apply)(params, changed, positions, mask)
  # Padding positions included: they attend only to themselves.
  np.testing.assert_allclose(logits[:, :-1], full[:, :-1], atol=1e-6, rtol=0)
  assert float(jnp.abs(logits[0, -1] - full[0, -1]).max()) > 1e-4


def test_rope_depends_only_on_relative_position():
  q = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
  k = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))

  def score(pq, pk):
    rq = rope.apply_rope(q, jnp.array([[pq]]), 10000.0)
    rk = rope.apply_rope(k, jnp.array([[pk]]), 10000.0)
    return float(jnp.sum(rq * rk))

  assert score(5, 2) == pytest.approx(score(13, 10), abs=1e-5)
  assert score(5, 2) != pytest.approx(score(5, 4), abs=1e-3)
  # Position 0 is the identity; HF rotate_half: x*cos + concat(-x2, x1)*sin.
  np.testing.assert_allclose(rope.apply_rope(q, jnp.array([[0]]), 1e4), q)
  x = np.asarray(q[0, 0, 0])
  ang = 3 * 10000.0 ** (-np.arange(0, 16, 2) / 16)
  cos, sin = np.cos(np.tile(ang, 2)), np.sin(np.tile(ang, 2))
  want = x * cos + np.concatenate([-x[8:], x[:8]]) * sin
  np.testing.assert_allclose(rope.apply_rope(q, jnp.array([[3]]), 1e4)[0, 0, 0],
                             want, atol=1e-5)


def test_logical_axis_names(setup):
  variables = setup[2]
  specs = nn.get_partition_spec(variables)["params"]
  P = jax.sharding.PartitionSpec
  dec = specs["decoder"]
  assert dec["embedder"]["embedding"] == P("vocab", "embed")
  layers = dec["layers"]  # Stacked (scan_layers): a leading 'layers' axis.
  assert layers["mlp"]["gate_proj"] == P("layers", "embed", "mlp")
  assert layers["mlp"]["down_proj"] == P("layers", "mlp", "embed")
  assert layers["attn"]["q_proj"] == P("layers", "embed", "heads", "head_dim")
  assert layers["attn"]["k_proj"] == P("layers", "embed", "kv_heads",
                                       "head_dim")
  assert layers["attn"]["o_proj"] == P("layers", "heads", "head_dim", "embed")
  assert layers["attn_norm"]["scale"] == P("layers", "embed")
  assert dec["final_norm"]["scale"] == P("embed")
  assert specs["lm_head"] == P("embed", "vocab")


def test_num_params_and_tied_embeddings():
  for tie in (False, True):
    cfg = ModelConfig.tiny(tie_embeddings=tie)
    tok = jnp.zeros((1, 4), jnp.int32)
    m = jnp.ones((1, 4), bool)
    model = tm.Transformer(cfg)
    params = tiny_models.init_params(model, jax.random.key(0), tok, tok,
                                     m)["params"]
    assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params()
    assert ("lm_head" in params) != tie
    if tie:  # Logits = final hidden . embedding^T.
      hidden, _ = jax.jit(tm.Decoder(cfg).apply)(
          {"params": params["decoder"]}, tok, tok, m)
      logits, _ = jax.jit(model.apply)({"params": params}, tok, tok, m)
      want = hidden @ params["decoder"]["embedder"]["embedding"].T
      np.testing.assert_allclose(logits, want, atol=1e-5)


def test_value_model_and_value_params_from_policy(setup):
  cfg, _, variables, params, tokens, mask, positions, _ = setup
  vparams = tm.value_params_from_policy(params, cfg, jax.random.key(3))
  # Backbone copied exactly, into fresh buffers (the trainer donates policy).
  flat_p = jax.tree.leaves(params["params"]["decoder"])
  flat_v = jax.tree.leaves(vparams["params"]["decoder"])
  assert len(flat_p) == len(flat_v)
  for a, b in zip(flat_p, flat_v):
    np.testing.assert_array_equal(a, b)
    assert a is not b
  values = tm.ValueModel(cfg).apply(vparams, tokens, positions, mask)
  assert values.shape == (B, T) and values.dtype == jnp.float32
  hidden, _ = tm.Decoder(cfg).apply(
      {"params": params["params"]["decoder"]}, tokens, positions, mask)
  head = vparams["params"]["value_head"]
  want = hidden @ head["kernel"][:, 0] + head["bias"][0]
  np.testing.assert_allclose(values, want, atol=1e-5)
  # Boxed in -> boxed out, with names on the head too.
  boxed = tm.value_params_from_policy(variables, cfg, jax.random.key(3))
  assert nn.get_partition_spec(boxed)["params"]["value_head"]["kernel"] == (
      jax.sharding.PartitionSpec("embed", None))


def test_value_head_init_std():
  cfg = ModelConfig.tiny(hidden_size=8192)
  head = tiny_models.init_params(tm.ValueHead(cfg), jax.random.key(0),
                                 jnp.zeros((1, 1, 8192)), unbox=False)
  kernel = np.asarray(nn.unbox(head)["params"]["kernel"])
  assert kernel.shape == (8192, 1)
  assert np.std(kernel) == pytest.approx(0.02, rel=0.05)
  assert abs(np.mean(kernel)) < 0.02 * 5 / np.sqrt(8192)
  np.testing.assert_array_equal(nn.unbox(head)["params"]["bias"], [0.0])


def test_jit_with_donated_cache_and_bf16_compute(setup):
  cfg, model, _, params, tokens, mask, positions, full = setup

  def step(params, cache, tok, pos, m):
    return model.apply(params, tok, pos, m, cache)

  step = jax.jit(step, donate_argnums=1)
  logits, cache = step(params, tm.init_cache(cfg, B, 16), tokens, positions,
                       mask)
  _close_on_real(logits, full, mask, 1e-5)
  assert int(cache.end) == T

  bf16 = tm.Transformer(ModelConfig.tiny(vocab_size=97, qkv_bias=True,
                                         rope_theta=500.0, dtype="bfloat16"))
  logits16, _ = jax.jit(bf16.apply)(params, tokens, positions, mask)
  assert logits16.dtype == jnp.float32
  _close_on_real(logits16, full, mask, 0.1)


def test_hf_config_round_trip_and_unsupported_features():
  for arch, bias in (("LlamaForCausalLM", False), ("Qwen2ForCausalLM", True)):
    cfg = ModelConfig.tiny(qkv_bias=bias, rope_theta=1e6, tie_embeddings=bias)
    assert ModelConfig.from_hf_config(cfg.to_hf_config(arch)) == cfg
  # transformers 4 layout: top-level rope_theta, rope_scaling null.
  v4 = {"architectures": ["LlamaForCausalLM"], "vocab_size": 10,
        "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
        "num_attention_heads": 2, "rope_theta": 5e5, "rope_scaling": None}
  cfg = ModelConfig.from_hf_config(v4)
  assert (cfg.rope_theta, cfg.num_kv_heads, cfg.head_dim) == (5e5, 2, 4)
  bad = {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
  with pytest.raises(UnsupportedConfigError, match="llama3"):
    ModelConfig.from_hf_config(v4 | bad)
  with pytest.raises(UnsupportedConfigError, match="GPT2LMHeadModel"):
    ModelConfig.from_hf_config(v4 | {"architectures": ["GPT2LMHeadModel"]})
  with pytest.raises(UnsupportedConfigError, match="Qwen2ForCausalLM instead"):
    ModelConfig.tiny(qkv_bias=True).to_hf_config("LlamaForCausalLM")


def test_num_params_matches_published_model_sizes():
  qwen25_05b = ModelConfig(
      vocab_size=151936, hidden_size=896, intermediate_size=4864,
      num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, qkv_bias=True,
      tie_embeddings=True)
  assert qwen25_05b.num_params() == 494_032_768  # HF model card / safetensors.
  llama32_1b = ModelConfig(
      vocab_size=128256, hidden_size=2048, intermediate_size=8192,
      num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
      tie_embeddings=True)
  assert llama32_1b.num_params() == 1_235_814_400


def test_value_head_zero_init_gives_a_constant_baseline(setup):
  cfg, _, _, params, tokens, mask, positions, _ = setup
  vparams = tm.value_params_from_policy(params, cfg, jax.random.key(3),
                                        head_std=0.0)
  np.testing.assert_array_equal(vparams["params"]["value_head"]["kernel"], 0.0)
  values = tm.ValueModel(cfg).apply(vparams, tokens, positions, mask)
  np.testing.assert_array_equal(values, 0.0)  # V = bias = 0 everywhere.
  wider = tm.value_params_from_policy(params, cfg, jax.random.key(3),
                                      head_std=0.5)
  # The same key, 25x the default std: the same draw scaled.
  default = tm.value_params_from_policy(params, cfg, jax.random.key(3))
  np.testing.assert_allclose(wider["params"]["value_head"]["kernel"],
                             25 * default["params"]["value_head"]["kernel"],
                             rtol=1e-5)
