"""configs/qwen3_235b_a22b.py: Qwen3-235B-A22B's architecture on a v5p-256.

Its parameters are what transformers' Qwen3MoeForCausalLM of the exported
config.json holds (built on the meta device: no memory); the run lays the
trainer over chips 0, 1 and the sampler over chips 2, 3 of each of the 32
hosts (the compiles are BENCHMARKS.md's "TPU slices on paper").
"""

import pytest

from configs import qwen3_235b_a22b
from sao_jax.aot import programs
from sao_jax.sampler import precision
from sao_jax.train import setup


def test_architecture_and_layout():
  config = qwen3_235b_a22b.get_config()
  mcfg = setup.model_config(config)
  assert mcfg.hf_architecture() == "Qwen3MoeForCausalLM"
  assert mcfg.num_params() == 235_093_634_560  # HF: 235B.
  assert (mcfg.num_layers, mcfg.num_moe_layers) == (94, 94)
  assert (mcfg.moe.num_experts, mcfg.moe.top_k,
          mcfg.moe.intermediate_size) == (128, 8, 1536)
  assert config.sampler.chips == "v5p-256:2,3"
  assert config.train.batch_size == 64  # A row per trainer chip.
  # The sampler's copy in bfloat16 (the slot holds two) is 470 GB: more
  # than a whole host's four 95 GiB chips hold.
  sampler_mcfg = precision.sampler_model_config(config, mcfg)
  assert sampler_mcfg.param_dtype == "bfloat16"
  one_copy = programs.weight_slot_bytes(sampler_mcfg) / 2
  assert 2 * 235.09e9 < one_copy < 2 * 235.1e9 + 2**20
  assert one_copy > 4 * 95 * 2**30


@pytest.mark.ref
def test_parameters_are_transformers_qwen3_moes():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  mcfg = setup.model_config(qwen3_235b_a22b.get_config())
  hf = transformers.Qwen3MoeConfig(
      **mcfg.to_hf_config("Qwen3MoeForCausalLM"))
  with torch.device("meta"):
    model = transformers.Qwen3MoeForCausalLM(hf)
  assert sum(p.numel() for p in model.parameters()) == mcfg.num_params()
