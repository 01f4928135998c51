"""configs/deepseek_v3_4l.py: DeepSeek-V3's shapes, cut to 4 layers.

Its parameters are what transformers' DeepseekV3ForCausalLM of the exported
config.json holds (built on the meta device: no memory), at 4 layers and at
the whole model's 61 (671B, DeepSeek-V3's published size without its
multi-token-prediction layer); the sampler's cache holds the latent. The
compiled figures are BENCHMARKS.md's "TPU slices on paper".
"""

import dataclasses

import pytest

from configs import deepseek_v3_4l
from sao_jax.train import memory
from sao_jax.train import setup

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.ref


@pytest.mark.parametrize("layers,params", [(4, 15_111_101_696),
                                           (61, 671_026_419_200)])
def test_parameters_are_transformers_deepseek_v3s(layers, params):
  mcfg = dataclasses.replace(
      setup.model_config(deepseek_v3_4l.get_config()), num_layers=layers)
  assert mcfg.hf_architecture() == "DeepseekV3ForCausalLM"
  assert mcfg.num_params() == params
  hf = transformers.DeepseekV3Config(
      **mcfg.to_hf_config("DeepseekV3ForCausalLM"))
  with torch.device("meta"):
    model = transformers.DeepseekV3ForCausalLM(hf)
  theirs = sum(p.numel() for p in model.parameters()) + sum(  # + router bias.
      b.numel() for n, b in model.named_buffers() if "e_score" in n)
  assert theirs == params


def test_the_cache_holds_the_latent():
  config = deepseek_v3_4l.get_config()
  mcfg = setup.model_config(config)
  est = memory.estimate_memory(mcfg, kv_batch=2, kv_len=8192)
  # 4 layers x 2 rows x 8192 slots x (512 + 64) bf16 values: 75.5 MB, not
  # the 4 x 2 x 8192 x 128 x (192 + 128) x 2 B = 5.4 GB of per-head K/V.
  assert est.kv_cache == 4 * 2 * 8192 * (512 + 64) * 2
