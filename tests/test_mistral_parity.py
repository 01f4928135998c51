"""Mistral (`MistralForCausalLM`, sliding window) vs transformers, float32.

A tiny random Mistral whose sliding window (4) is shorter than every test
sequence, every weight perturbed, eager attention: logits on a left-padded
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

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import hf_reference  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.ref

WINDOW = 4
NEW_TOKENS = 32


def _batch():
  return hf_reference.left_padded_batch(length=11, pads=(0, 3, 5), seed=1)


_hf_logits = hf_reference.hf_logits
_our_logits = hf_reference.our_logits


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  torch.manual_seed(0)
  config = transformers.MistralConfig(
      vocab_size=128, hidden_size=64, intermediate_size=96,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      head_dim=16, rms_norm_eps=1e-5, sliding_window=WINDOW,
      max_position_embeddings=128, tie_word_embeddings=False,
      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
      attn_implementation="eager")
  model = transformers.MistralForCausalLM(config).eval()
  with torch.no_grad():  # HF inits norms to 1: perturb every weight.
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.2 * torch.randn_like(p))
  path = tmp_path_factory.mktemp("mistral") / "hf"
  model.save_pretrained(path)
  return path, model, _hf_logits(model, *_batch())


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "unrolled"])
@pytest.mark.parametrize("attn", ["dense", "blockwise"])
def test_mistral_logits_match_transformers(reference, scan, attn):
  path, _, want = reference
  config, params = hf.load_hf_checkpoint(path, scan_layers=scan)
  assert config.sliding_window == WINDOW and not config.qkv_bias
  assert config.hf_architecture() == "MistralForCausalLM"
  assert sum(x.size for x in jax.tree.leaves(params)) == config.num_params()
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
def test_mistral_packed_row_equals_trajectories_alone(reference, attn):
  path, model, _ = reference
  hf_reference.check_packed_row_equals_trajectories_alone(path, model, attn)


def test_mistral_greedy_continuation_through_the_kv_cache(reference):
  """32 greedy tokens per prompt (far past the window) equal HF `generate`;
  the recorded log-probs equal the trainer's full forward."""
  path, model, _ = reference
  tokens, mask, _ = _batch()
  hf_reference.check_greedy_continuation(path, model, tokens, mask,
                                         NEW_TOKENS)


def test_mistral_export_reloads_in_transformers(reference, tmp_path):
  path, _, want = reference
  saved = hf_reference.check_export_reloads(path, want, tmp_path,
                                            "MistralForCausalLM", _batch())
  assert saved["sliding_window"] == WINDOW


def test_mistral_config_conversion_and_refusals():
  cfg = ModelConfig.tiny(sliding_window=8)
  hf_cfg = cfg.to_hf_config(cfg.hf_architecture())
  assert hf_cfg["architectures"] == ["MistralForCausalLM"]
  assert ModelConfig.from_hf_config(hf_cfg) == cfg
  no_window = ModelConfig.from_hf_config(hf_cfg | {"sliding_window": None})
  assert no_window.sliding_window == 0
  assert no_window.to_hf_config("MistralForCausalLM")["sliding_window"] is None
  with pytest.raises(UnsupportedConfigError, match="export as Mistral"):
    cfg.to_hf_config("LlamaForCausalLM")
  with pytest.raises(UnsupportedConfigError, match="layer_types"):
    ModelConfig.from_hf_config(hf_cfg | {
        "layer_types": ["sliding_attention", "full_attention"]})
  with pytest.raises(UnsupportedConfigError, match="qkv_bias"):
    ModelConfig.tiny(qkv_bias=True).to_hf_config("MistralForCausalLM")
