"""Gemma 3 text (`Gemma3ForCausalLM`) vs transformers, float32.

A tiny random Gemma 3 (sliding and full layers interleaved, their own RoPE
bases, linear RoPE scaling on the full layers, query_pre_attn_scalar !=
head_dim) whose sliding window (4) is shorter than every test sequence,
every weight perturbed, eager attention: logits on a left-padded
batch within 1e-4 of transformers through the dense and the blockwise paths,
scanned and unrolled; packed rows equal their trajectories run alone; a
greedy 32-token continuation through the sampler's KV cache equals
transformers' `generate`, and its recorded log-probs equal the trainer's
full forward; export -> transformers load -> the same logits.
"""

import dataclasses

import jax
import numpy as np
import pytest

from sao_jax.models import hf
from sao_jax.models.config import ModelConfig
from sao_jax.models.config import UnsupportedConfigError
from sao_jax.train import memory
from sao_jax.train import optim

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import hf_reference  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.ref

WINDOW = 4
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention",
               "sliding_attention"]
NEW_TOKENS = 32


def _batch():
  return hf_reference.left_padded_batch(length=11, pads=(0, 3, 5), seed=1)


_hf_logits = hf_reference.hf_logits
_our_logits = hf_reference.our_logits


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  torch.manual_seed(0)
  config = transformers.Gemma3TextConfig(
      vocab_size=128, hidden_size=64, intermediate_size=96,
      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
      head_dim=16, rms_norm_eps=1e-6, sliding_window=WINDOW,
      max_position_embeddings=128, query_pre_attn_scalar=24,
      layer_types=LAYER_TYPES,
      rope_parameters={
          "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
          "full_attention": {"rope_type": "linear", "factor": 2.0,
                             "rope_theta": 10000.0}},
      attn_implementation="eager")
  config.architectures = ["Gemma3ForCausalLM"]
  model = transformers.Gemma3ForCausalLM(config).eval()
  with torch.no_grad():  # HF inits (1 + w) norms to 0: perturb every weight.
    for _, p in model.named_parameters():
      p.copy_(0.2 * torch.randn_like(p))
  path = tmp_path_factory.mktemp("gemma3") / "hf"
  model.save_pretrained(path)
  return path, model, _hf_logits(model, *_batch())


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("attn", ["dense", "blockwise"])
def test_gemma3_logits_match_transformers(reference, scan, attn):
  path, _, want = reference
  config, params = hf.load_hf_checkpoint(path, scan_layers=scan)
  assert config.sliding_window == WINDOW and config.qk_norm
  assert config.layer_types == tuple(LAYER_TYPES) and config.tie_embeddings
  assert config.local_rope_theta == 100.0 and config.rope_theta == 10000.0
  assert config.hf_architecture() == "Gemma3ForCausalLM"
  assert sum(x.size for x in jax.tree.leaves(params)) == config.num_params()
  attention = sum(x.size for k, x in jax.tree_util.tree_leaves_with_path(
      params) if optim.path_is_attention(k))
  assert attention == memory.attention_params(config)
  config = dataclasses.replace(config, attention=attn, attention_block_q=3,
                               attention_block_kv=2)
  tokens, mask, positions = _batch()
  got = _our_logits(config, params, tokens, mask, positions)
  assert np.abs(got[mask] - want[mask]).max() <= 1e-4
  assert np.abs(want[mask]).max() > 0.1
  # The window really applies: without it the logits differ.
  full = _our_logits(dataclasses.replace(config, sliding_window=0), params,
                     tokens, mask, positions)
  assert np.abs(full[mask] - want[mask]).max() > 1e-2


@pytest.mark.parametrize("attn", ["dense", "blockwise"])
def test_gemma3_packed_row_equals_trajectories_alone(reference, attn):
  path, model, _ = reference
  hf_reference.check_packed_row_equals_trajectories_alone(path, model, attn)


def test_gemma3_greedy_continuation_through_the_kv_cache(reference):
  """32 greedy tokens per prompt (far past the window) equal HF `generate`;
  the recorded log-probs equal the trainer's full forward."""
  path, model, _ = reference
  tokens, mask, _ = _batch()
  hf_reference.check_greedy_continuation(path, model, tokens, mask,
                                         NEW_TOKENS)


def test_gemma3_export_reloads_in_transformers(reference, tmp_path):
  path, _, want = reference
  saved = hf_reference.check_export_reloads(path, want, tmp_path,
                                            "Gemma3ForCausalLM", _batch())
  assert saved["sliding_window"] == WINDOW


def test_gemma3_config_conversion_and_refusals():
  cfg = ModelConfig.tiny(
      num_layers=3, sliding_window=8, qk_norm=True, tie_embeddings=True,
      layer_types=("sliding_attention",) * 2 + ("full_attention",),
      local_rope_theta=10000.0, query_pre_attn_scalar=32.0,
      norm_style="gemma", mlp_activation="gelu_tanh")
  hf_cfg = cfg.to_hf_config(cfg.hf_architecture())
  assert hf_cfg["architectures"] == ["Gemma3ForCausalLM"]
  assert ModelConfig.from_hf_config(hf_cfg) == cfg
  with pytest.raises(UnsupportedConfigError, match="export as Gemma3"):
    cfg.to_hf_config("LlamaForCausalLM")
  with pytest.raises(UnsupportedConfigError, match="softcapping"):
    ModelConfig.from_hf_config(hf_cfg | {"final_logit_softcapping": 30.0})
  with pytest.raises(UnsupportedConfigError, match="Gemma3ForCausalLM needs"):
    ModelConfig.tiny().to_hf_config("Gemma3ForCausalLM")
  with pytest.raises(ValueError, match="layer_types"):
    ModelConfig.tiny(layer_types=("full_attention",))
