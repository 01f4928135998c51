"""RoPE scaling (linear, llama3, yarn, dynamic, longrope) vs transformers,
float32.

Frequencies: `rope.inv_frequencies` vs transformers' `ROPE_INIT_FUNCTIONS`.
Models: tiny random `LlamaForCausalLM` checkpoints with each rope_type (Llama
3.x uses `llama3`), loaded by `load_hf_checkpoint`: logits on a left-padded
batch within 1e-4 of transformers, and export -> transformers load -> the
same logits.
"""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

import decode_parity

from sao_jax.models import hf
from sao_jax.models.config import ModelConfig
from sao_jax.models.config import UnsupportedConfigError
from sao_jax.models.layers import rope

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import hf_reference  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.ref

# rope_type -> HF rope_parameters (besides rope_theta). Small context lengths
# so that every regime of each scaling shows within a 10-token batch.
SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0,
             "original_max_position_embeddings": 32},
    "yarn_mscale": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16,
                    "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5,
                    "original_max_position_embeddings": 16},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    # Factors per frequency (filled in by _hf_config for the head_dim).
    "longrope": {"rope_type": "longrope", "factor": 4.0,
                 "original_max_position_embeddings": 8},
}
MAX_POS = 8  # Shorter than the batch: dynamic NTK rescales, longrope is long.


def _longrope_factors(head_dim: int) -> dict[str, list[float]]:
  i = np.arange(head_dim // 2)
  return {"short_factor": list(1.0 + 0.1 * i),
          "long_factor": list(1.0 + 0.5 * i ** 1.5)}


def _hf_config(name, head_dim=16, theta=500000.0):
  return transformers.LlamaConfig(
      vocab_size=128, hidden_size=64, intermediate_size=96,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
      head_dim=head_dim, rms_norm_eps=1e-5, max_position_embeddings=MAX_POS,
      tie_word_embeddings=True, attn_implementation="eager",
      rope_parameters={**SCALINGS[name], "rope_theta": theta,
                       **(_longrope_factors(head_dim) if name == "longrope"
                          else {})})


@pytest.mark.parametrize("name", sorted(set(SCALINGS) - {"dynamic"}))
@pytest.mark.parametrize("head_dim,theta", [(16, 500000.0), (64, 10000.0)])
def test_inv_freq_matches_transformers(name, head_dim, theta):
  config = _hf_config(name, head_dim, theta)
  rope_type = SCALINGS[name]["rope_type"]
  want, want_scale = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[
      rope_type](config, "cpu")
  ours = ModelConfig.from_hf_config(config.to_dict())
  got, scale = rope.inv_frequencies(head_dim, ours.rope_theta,
                                    ours.rope_scaling)
  assert got.dtype == np.float32
  np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=0)
  assert scale == pytest.approx(float(want_scale), rel=1e-7)
  plain, _ = rope.inv_frequencies(head_dim, theta)
  assert np.abs(got - plain).max() > 1e-3 * plain.max()  # Really scaled.


def test_longrope_switches_to_long_factors_past_the_original_length():
  config = _hf_config("longrope")
  init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["longrope"]
  ours = ModelConfig.from_hf_config(config.to_dict())
  for length in (4, MAX_POS, MAX_POS + 1, 37):
    want, want_scale = init(config, "cpu", seq_len=length)
    positions = jnp.arange(length, dtype=jnp.int32)[None]
    got, scale = rope.longrope_frequencies(16, ours.rope_theta,
                                           ours.rope_scaling, positions)
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=1e-6)
    assert scale == pytest.approx(float(want_scale), rel=1e-7) != 1.0
  short, _ = rope.longrope_frequencies(16, 500000.0, ours.rope_scaling,
                                       jnp.arange(MAX_POS)[None])
  long, _ = rope.longrope_frequencies(16, 500000.0, ours.rope_scaling,
                                      jnp.arange(MAX_POS + 1)[None])
  assert np.abs(np.asarray(long) - np.asarray(short)).max() > 1e-3


def test_dynamic_inv_freq_matches_transformers_beyond_max_positions():
  config = _hf_config("dynamic")
  init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["dynamic"]
  ours = ModelConfig.from_hf_config(config.to_dict())
  s = dict(ours.rope_scaling)
  for length in (4, MAX_POS, 10, 37):
    want, _ = init(config, "cpu", seq_len=length)
    positions = jnp.arange(length, dtype=jnp.int32)[None]
    got = rope._dynamic_inv_freq(16, ours.rope_theta, s, positions)  # pylint: disable=protected-access
    np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=2e-6)


def _batch():
  return hf_reference.left_padded_batch()


_hf_logits = hf_reference.hf_logits


_our_logits = hf_reference.our_logits


@pytest.fixture(scope="module", params=sorted(SCALINGS))
def reference(request, tmp_path_factory):
  path = tmp_path_factory.mktemp(request.param) / "hf"
  model = hf_reference.save_random_model(
      transformers.LlamaForCausalLM, _hf_config(request.param), path,
      scale=0.3)
  return request.param, path, _hf_logits(model, *_batch()), model


def test_llama_with_rope_scaling_matches_transformers(reference, tmp_path):
  name, path, want, _ = reference
  config, params = hf.load_hf_checkpoint(path)
  assert dict(config.rope_scaling)["rope_type"] == SCALINGS[name]["rope_type"]
  tokens, mask, positions = _batch()
  got = _our_logits(config, params, tokens, mask, positions)
  assert np.abs(got[mask] - want[mask]).max() <= 1e-4
  # The scaling matters here: plain RoPE gives other logits.
  plain = _our_logits(ModelConfig.from_hf_config(
      {**json.loads((path / "config.json").read_text()),
       "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}),
                      params, tokens, mask, positions)
  assert np.abs(plain[mask] - want[mask]).max() > 1e-3
  # Export -> transformers load -> the same logits.
  hf.save_hf_checkpoint(config, params, tmp_path, arch="LlamaForCausalLM")
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved["rope_parameters"]["rope_type"] == SCALINGS[name]["rope_type"]
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, attn_implementation="eager").eval()
  again = _hf_logits(reloaded, tokens, mask, positions)
  assert np.abs(again[mask] - want[mask]).max() <= 1e-4
  assert ModelConfig.from_hf_config(saved) == config


# Not longrope: its short/long switch is checked above and the sampler's
# path is the Phi-3 row's (tests/models/test_family_parity.py).
@pytest.mark.parametrize("reference", sorted(set(SCALINGS) - {"longrope"}),
                         indirect=True)
def test_sampler_decode_matches_transformers(reference):
  """Greedy 32 tokens = HF generate (positions run past every context
  length above); the sampler's log-probs = the trainer's forward."""
  name, path, _, _ = reference
  config, params = hf.load_hf_checkpoint(path)
  decode_parity.check_greedy_matches_generate(
      config, params, lambda: transformers.AutoModelForCausalLM.from_pretrained(
          path, attn_implementation="eager").eval(), torch)
  if name != "dynamic":
    decode_parity.check_sampler_logprobs_equal_full_forward(config, params)
    return
  # Dynamic NTK rescales by the sequence's length: past max_position_embeddings
  # the sampler's incremental steps and the trainer's full forward use other
  # frequencies (as transformers' do), so the log-probs differ; within it they
  # are equal. config_validation refuses runs whose sequences pass it (and
  # longrope's past original_max_position_embeddings, for the same reason).
  with pytest.raises(AssertionError, match="Mismatched elements"):
    decode_parity.check_sampler_logprobs_equal_full_forward(config, params)
  within = dataclasses.replace(config, rope_scaling={
      **dict(config.rope_scaling), "max_position_embeddings": 64})
  decode_parity.check_sampler_logprobs_equal_full_forward(within, params)


def test_config_round_trip_and_errors():
  hf_cfg = _hf_config("llama3").to_dict()
  config = ModelConfig.from_hf_config(hf_cfg)
  assert config.rope_scaling == tuple(sorted(SCALINGS["llama3"].items()))
  assert ModelConfig.from_hf_config(config.to_hf_config()) == config
  # transformers 4 layout: rope_scaling with "type", rope_theta at the top.
  v4 = {k: v for k, v in hf_cfg.items() if k != "rope_parameters"}
  v4 |= {"rope_theta": 500000.0, "rope_scaling": {
      "type": "linear", "factor": 4.0}}
  assert ModelConfig.from_hf_config(v4).rope_scaling == (
      ("factor", 4.0), ("rope_type", "linear"))
  with pytest.raises(UnsupportedConfigError, match="'ntk_parts'.*supported"):
    ModelConfig.from_hf_config(hf_cfg | {"rope_parameters": {
        "rope_type": "ntk_parts", "rope_theta": 1.0}})
  with pytest.raises(UnsupportedConfigError,
                     match="longrope.*missing keys.*long_factor"):
    ModelConfig.from_hf_config(hf_cfg | {"rope_parameters": {
        "rope_type": "longrope", "rope_theta": 1.0}})
  with pytest.raises(UnsupportedConfigError, match="missing keys.*factor"):
    ModelConfig.from_hf_config(hf_cfg | {"rope_parameters": {
        "rope_type": "linear", "rope_theta": 1.0}})
  with pytest.raises(ValueError, match="unsupported keys.*'beta'"):
    ModelConfig.tiny(rope_scaling={"rope_type": "linear", "factor": 2.0,
                                   "beta": 1})
  assert ModelConfig.tiny(rope_scaling={"rope_type": "default"}) == (
      ModelConfig.tiny())
