"""configs/llama3_3_70b.py: Llama-3.3-70B's architecture on a v5p-128.

Its parameters are what transformers' LlamaForCausalLM of the exported
config.json holds (built on the meta device: no memory); the run lays the
trainer over chips 0, 1 and the sampler over chips 2, 3 of each of the 16
hosts (the whole model's compiles are BENCHMARKS.md's "TPU slices on
paper").
"""

import pytest

from configs import llama3_3_70b
from sao_jax.sampler import mesh as mesh_lib
from sao_jax.train import setup


def test_architecture_and_layout():
  config = llama3_3_70b.get_config()
  mcfg = setup.model_config(config)
  assert mcfg.hf_architecture() == "LlamaForCausalLM"
  assert mcfg.num_params() == 70_553_706_496  # HF: 70.6B.
  assert (mcfg.num_layers, mcfg.hidden_size, mcfg.num_heads,
          mcfg.num_kv_heads, mcfg.vocab_size) == (80, 8192, 64, 8, 128256)
  assert dict(mcfg.rope_scaling)["rope_type"] == "llama3"
  # 32 trainer chips, a row each; the sampler over its 2 chips of a host.
  assert config.sampler.chips == "v5p-128:2,3"
  assert config.train.batch_size == 32
  assert mesh_lib.mesh_sizes(config) == (1, 1, -1)


@pytest.mark.ref
def test_parameters_are_transformers_llamas():
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  mcfg = setup.model_config(llama3_3_70b.get_config())
  hf = transformers.LlamaConfig(**mcfg.to_hf_config("LlamaForCausalLM"))
  assert hf.rope_parameters["rope_type"] == "llama3"
  with torch.device("meta"):
    model = transformers.LlamaForCausalLM(hf)
  assert sum(p.numel() for p in model.parameters()) == mcfg.num_params()
