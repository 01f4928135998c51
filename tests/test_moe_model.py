"""Mixture-of-experts decoders against transformers' `Qwen3MoeForCausalLM`
and `Glm4MoeForCausalLM`: import, logits on a left-padded batch, export, the
scanned and unrolled layouts, the recorded routing and its replay (R3)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sao_jax.models import hf
from sao_jax.models import transformer as tm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import hf_reference  # pylint: disable=g-import-not-at-top,wrong-import-position
safetensors_numpy = pytest.importorskip("safetensors.numpy")

pytestmark = [pytest.mark.ref, pytest.mark.slow]
V = 96


def _qwen3_moe_config():
  # Qwen3-MoE at a tiny size: softmax top-k with renormalised weights, q/k
  # norms, a dense first layer (mlp_only_layers), untied head.
  return transformers.Qwen3MoeConfig(
      vocab_size=V, hidden_size=32, intermediate_size=48,
      moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
      num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
      norm_topk_prob=True, mlp_only_layers=[0], decoder_sparse_step=1,
      rms_norm_eps=1e-5, rope_parameters={"rope_type": "default",
                                          "rope_theta": 500.0},
      tie_word_embeddings=False, attn_implementation="eager")


def _glm4_moe_config():
  # Every GLM-4.5 routing feature at a tiny size: one dense layer first,
  # grouped sigmoid routing with a score-correction bias, routed scaling, a
  # shared expert, q/k/v biases, q/k norms and partial rotary.
  return transformers.Glm4MoeConfig(
      vocab_size=V, hidden_size=32, intermediate_size=48,
      moe_intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
      num_key_value_heads=2, head_dim=8, n_routed_experts=8,
      num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
      routed_scaling_factor=1.5, first_k_dense_replace=1, norm_topk_prob=True,
      attention_bias=True, use_qk_norm=True, rms_norm_eps=1e-5,
      rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                       "partial_rotary_factor": 0.5},
      tie_word_embeddings=False, attn_implementation="eager")


def _batch():
  return hf_reference.left_padded_batch(vocab=V)


_hf_logits = hf_reference.hf_logits


def _ours(config, params, tokens, mask, positions, routing=None):
  (logits, _), state = tm.Transformer(config).apply(
      {"params": params}, jnp.asarray(tokens), jnp.asarray(positions),
      jnp.asarray(mask), routing=routing, mutable=["moe"])
  return np.asarray(logits), tm.moe_outputs(state)


FAMILIES = {"Qwen3MoeForCausalLM": _qwen3_moe_config,
            "Glm4MoeForCausalLM": _glm4_moe_config}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def reference(request, tmp_path_factory):
  torch.manual_seed(0)
  arch = request.param
  model = getattr(transformers, arch)(FAMILIES[arch]()).eval()
  with torch.no_grad():
    for name, p in list(model.named_parameters()) + list(
        model.named_buffers()):
      if name.endswith("inv_freq"):
        continue
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.2 * torch.randn_like(p))
  path = tmp_path_factory.mktemp(arch) / "hf"
  model.save_pretrained(path)
  return model, path, _hf_logits(model, *_batch())


def test_import_matches_transformers(reference):
  model, path, want = reference
  config, params = hf.load_hf_checkpoint(path)
  assert config.moe.num_experts == 8 and config.first_dense_layers == 1
  assert config.num_moe_layers == 2 and config.qk_norm
  glm = type(model).__name__ == "Glm4MoeForCausalLM"
  assert config.rotary_dim == (4 if glm else 0)
  assert config.moe.router == ("sigmoid" if glm else "softmax")
  assert params["decoder"]["moe_layers"]["moe"]["gate_proj"].shape == (
      2, 8, 32, 16)
  tokens, mask, positions = _batch()
  got, moe = _ours(config, params, tokens, mask, positions)
  assert np.abs(got[mask] - want[mask]).max() <= 1e-4
  assert np.abs(want[mask]).max() > 0.1
  assert sum(x.size for x in jax.tree.leaves(params)) == config.num_params()
  experts = np.asarray(moe["experts"])
  assert experts.shape == (3, 10, 2, 2)  # [B, T, M, k]
  assert float(moe["aux_loss"]) > 0


def test_unrolled_layout_and_export_match(reference, tmp_path):
  model, path, want = reference
  config, params = hf.load_hf_checkpoint(path)
  flat_cfg, flat = hf.load_hf_checkpoint(path, scan_layers=False)
  tokens, mask, positions = _batch()
  scanned, m1 = _ours(config, params, tokens, mask, positions)
  unrolled, m2 = _ours(flat_cfg, flat, tokens, mask, positions)
  np.testing.assert_allclose(unrolled, scanned, atol=1e-5)
  np.testing.assert_array_equal(m1["experts"], m2["experts"])
  hf.save_hf_checkpoint(config, params, tmp_path,
                        arch=config.hf_architecture())
  assert config.hf_architecture() == type(model).__name__
  theirs = safetensors_numpy.load_file(os.path.join(path, "model.safetensors"))
  ours = safetensors_numpy.load_file(
      os.path.join(tmp_path, "model.safetensors"))
  assert sorted(ours) == sorted(theirs)
  for name in theirs:
    np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  got = _hf_logits(reloaded, tokens, mask, positions)
  assert np.abs(got[mask] - want[mask]).max() <= 1e-4
  del model


def test_replay_reproduces_recorded_routing(reference):
  _, path, _ = reference
  config, params = hf.load_hf_checkpoint(path)
  tokens, mask, positions = _batch()
  logits, moe = _ours(config, params, tokens, mask, positions)
  recorded = moe["experts"]
  replayed, again = _ours(config, params, tokens, mask, positions,
                          routing=recorded)
  np.testing.assert_allclose(replayed, logits, atol=1e-6)
  np.testing.assert_array_equal(again["experts"], recorded)
  # Replaying other experts changes the function, and uses exactly those.
  other = (np.asarray(recorded) + 1) % 8
  changed, used = _ours(config, params, tokens, mask, positions,
                        routing=jnp.asarray(other))
  np.testing.assert_array_equal(used["experts"], other)
  # The router's own choice is still reported (the agreement metric): in
  # the first MoE layer it is the recorded one (later layers see hidden
  # states computed with the replayed experts).
  np.testing.assert_array_equal(used["own_experts"][:, :, 0],
                                np.asarray(recorded)[:, :, 0])
  assert np.abs(changed[mask] - logits[mask]).max() > 1e-3


def test_kv_cache_decode_matches_full_forward(reference):
  _, path, _ = reference
  config, params = hf.load_hf_checkpoint(path)
  tokens, mask, positions = _batch()
  full, _ = _ours(config, params, tokens, mask, positions)
  model = tm.Transformer(config)
  cache = tm.init_cache(config, 3, 12)
  pre, cache = model.apply({"params": params}, jnp.asarray(tokens[:, :7]),
                           jnp.asarray(positions[:, :7]),
                           jnp.asarray(mask[:, :7]), cache)
  outs = [pre]
  for t in range(7, 10):
    step, cache = model.apply(
        {"params": params}, jnp.asarray(tokens[:, t:t + 1]),
        jnp.asarray(positions[:, t:t + 1]), jnp.asarray(mask[:, t:t + 1]),
        cache)
    outs.append(step)
  got = np.concatenate([np.asarray(o) for o in outs], axis=1)
  assert np.abs(got[mask] - full[mask]).max() <= 1e-4
