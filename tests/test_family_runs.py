"""A tiny random checkpoint of each newly supported family trains with SAO.

Llama 3.x (`rope_type` llama3, Llama 3.2's chat template) and Qwen3 (q/k
norms, its template with thinking off and JSON tool calls, the calculator
tool env): a checkpoint directory built with transformers (random weights)
plus the family's tiny tokenizer (tests/family_tokenizers.py) runs
`train_and_evaluate` with `model.init_from=DIR`, `tokenizer.path=DIR` for a
few synchronous SAO steps: the run finishes and trains every step.
"""

import dataclasses
import json

import pytest

from sao_jax.models.config import ModelConfig
from sao_jax.train import loop
from sao_jax.tokenization import hf_tokenizer

import family_tokenizers
from tiny_settings import tiny_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.ref, pytest.mark.slow, pytest.mark.multiprocess]

_ARCH = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=1, head_dim=16,
             tie_word_embeddings=True)
FAMILIES = {
    "llama3": (lambda vocab: transformers.LlamaConfig(
        vocab_size=vocab, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, **_ARCH),
               {"env.chat_template_kwargs": {"date_string": "26 Jul 2024"}}),
    "qwen3": (lambda vocab: transformers.Qwen3Config(vocab_size=vocab,
                                                     **_ARCH),
              {"env.name": "tool", "env.max_turns": 2,
               "env.chat_template_kwargs": {"enable_thinking": False}}),
}
_MODEL_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
               "num_heads", "num_kv_heads", "head_dim", "rope_theta",
               "rope_scaling", "rms_norm_eps", "qkv_bias", "qk_norm",
               "tie_embeddings")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_checkpoint_trains_with_sao(family, tmp_path):
  make_config, env_overrides = FAMILIES[family]
  ckpt = family_tokenizers.build(family, tmp_path / "ckpt")
  vocab = hf_tokenizer.HFTokenizer.load(ckpt, {"date_string": "x"}).vocab_size
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(make_config(vocab))
  model.save_pretrained(ckpt)
  mcfg = ModelConfig.from_hf_config(json.loads(
      (ckpt / "config.json").read_text()))
  model_overrides = {f"model.{k}": v for k, v in dataclasses.asdict(
      mcfg).items() if k in _MODEL_KEYS}
  model_overrides["model.rope_scaling"] = dict(mcfg.rope_scaling)
  config = tiny_config(**{
      **model_overrides, **env_overrides,
      "model.init_from": str(ckpt), "tokenizer.path": str(ckpt),
      "train.mode": "sync", "train.num_steps": 2, "train.checkpoint_every": 0,
      "sampler.max_total_tokens": 640, "train.max_seq_len": 640,
      "sampler.max_new_tokens": 8})
  summary = loop.train_and_evaluate(config, str(tmp_path / "run"))
  assert summary["steps"] == 3  # The critic warm-up step and two SAO steps.
  assert summary["trajectories_trained"] == 3 * 8
  assert summary["policy_version"] == 2
