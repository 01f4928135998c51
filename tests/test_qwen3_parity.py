"""Qwen3 dense (per-head q/k RMSNorm, explicit head_dim, no biases) vs HF.

A tiny random `Qwen3ForCausalLM` in float32 with eager attention, every
weight (norms included) perturbed: logits on a left-padded batch within 1e-4
of transformers, export -> transformers load -> the same logits.
"""

import dataclasses
import json

import jax
import numpy as np
import pytest

import decode_parity

from sao_jax.models import hf
from sao_jax.models.config import ModelConfig
from sao_jax.models.config import UnsupportedConfigError
from sao_jax.train import memory

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import hf_reference  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.ref


def _batch():
  return hf_reference.left_padded_batch(length=11, pads=(0, 3, 8), seed=1)


_hf_logits = hf_reference.hf_logits


_our_logits = hf_reference.our_logits


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def reference(request, tmp_path_factory):
  torch.manual_seed(0)
  config = transformers.Qwen3Config(
      vocab_size=128, hidden_size=64, intermediate_size=96,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      head_dim=24, rms_norm_eps=1e-6, tie_word_embeddings=request.param,
      rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
      attn_implementation="eager")
  model = transformers.Qwen3ForCausalLM(config).eval()
  with torch.no_grad():  # HF inits norms to 1: perturb every weight.
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      else:
        p.copy_(0.2 * torch.randn_like(p))
  path = tmp_path_factory.mktemp("qwen3") / "hf"
  model.save_pretrained(path)
  return path, _hf_logits(model, *_batch()), model


def test_qwen3_matches_transformers_and_exports(reference, tmp_path):
  path, want, _ = reference
  config, params = hf.load_hf_checkpoint(path)
  assert config.qk_norm and not config.qkv_bias and config.head_dim == 24
  assert config.hf_architecture() == "Qwen3ForCausalLM"
  tokens, mask, positions = _batch()
  got = _our_logits(config, params, tokens, mask, positions)
  assert np.abs(got[mask] - want[mask]).max() <= 1e-4
  assert np.abs(want[mask]).max() > 0.1
  n = sum(x.size for x in jax.tree.leaves(params))
  assert n == config.num_params()
  attn = params["decoder"]["layers"]["attn"]  # Stacked: [L, ...] leaves.
  assert attn["q_norm"]["scale"].shape == attn["k_norm"]["scale"].shape == (
      config.num_layers, 24)
  # The q/k norms are attention parameters (frozen with the attention).
  attention = sum(x.size for k, x in jax.tree_util.tree_leaves_with_path(
      params) if "attn" in jax.tree_util.keystr(k))
  assert attention == memory.attention_params(config)
  # Without the q/k norms the logits differ: they are really applied.
  layers = {"layers": dict(params["decoder"]["layers"])}
  for layer in layers.values():
    layer["attn"] = {k: v for k, v in layer["attn"].items()
                     if not k.endswith("_norm")}
  plain = _our_logits(dataclasses.replace(config, qk_norm=False),
                      {**params, "decoder": {**params["decoder"], **layers}},
                      tokens, mask, positions)
  assert np.abs(plain[mask] - want[mask]).max() > 1e-2
  hf.save_hf_checkpoint(config, params, tmp_path)  # Its own architecture.
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved["architectures"] == ["Qwen3ForCausalLM"]
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  assert type(reloaded).__name__ == "Qwen3ForCausalLM"
  again = _hf_logits(reloaded, tokens, mask, positions)
  assert np.abs(again[mask] - want[mask]).max() <= 1e-4
  assert ModelConfig.from_hf_config(saved) == config


def test_sampler_decode_matches_transformers(reference):
  """Greedy 32 tokens = HF generate; sampler log-probs = full forward."""
  path, _, _ = reference
  config, params = hf.load_hf_checkpoint(path)
  decode_parity.check_greedy_matches_generate(
      config, params, lambda: transformers.AutoModelForCausalLM.from_pretrained(
          path, attn_implementation="eager").eval(), torch)
  decode_parity.check_sampler_logprobs_equal_full_forward(config, params)


def test_qwen3_config_errors():
  cfg = ModelConfig.tiny(qk_norm=True)
  with pytest.raises(UnsupportedConfigError, match="export as Qwen3"):
    cfg.to_hf_config("LlamaForCausalLM")
  with pytest.raises(UnsupportedConfigError, match="Qwen3ForCausalLM"):
    ModelConfig.tiny().to_hf_config("Qwen3ForCausalLM")
  hf_cfg = cfg.to_hf_config("Qwen3ForCausalLM")
  assert ModelConfig.from_hf_config(hf_cfg) == cfg
  with pytest.raises(UnsupportedConfigError, match="attention_bias"):
    ModelConfig.from_hf_config(hf_cfg | {"attention_bias": True})
  with pytest.raises(UnsupportedConfigError, match="use_sliding_window"):
    ModelConfig.from_hf_config(hf_cfg | {"use_sliding_window": True})
