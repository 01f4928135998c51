"""configs/qwen3_5_hybrid.py: a real-size Qwen3.5 hybrid decoder, and its AOT.

Its parameters are what transformers' Qwen3_5ForCausalLM of the exported
config.json holds (built on the meta device: no memory), whole and cut to
one layer-pattern repeat; the sampler's cache holds the linear layers'
fixed-size state; and, where libtpu loads, the SAO step and the decode
chunk of one pattern repeat (three Gated DeltaNet layers, one full) at its
full width with a small vocabulary compile for a v5p-64 (the whole model's
figures are BENCHMARKS.md's "TPU slices on paper").
"""

import pytest

import fresh_process

from configs import qwen3_5_hybrid
from sao_jax.train import memory
from sao_jax.train import setup

_OK, _WHY = fresh_process.libtpu_available()


@pytest.mark.ref
@pytest.mark.parametrize("layers,params", [("4", 2_899_186_752),
                                           ("32", 8_953_803_264)])
def test_parameters_are_transformers_qwen3_5s(layers, params):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  mcfg = setup.model_config(qwen3_5_hybrid.get_config(layers))
  assert mcfg.hf_architecture() == "Qwen3_5ForCausalLM"
  assert mcfg.layer_pattern() == 4 and mcfg.num_layers == int(layers)
  assert mcfg.num_params() == params
  hf = transformers.Qwen3_5TextConfig(
      **mcfg.to_hf_config("Qwen3_5ForCausalLM"))
  with torch.device("meta"):
    model = transformers.Qwen3_5ForCausalLM(hf)
  assert sum(p.numel() for p in model.parameters()) == params


def test_layers_must_repeat_the_pattern():
  with pytest.raises(ValueError, match="multiple of 4"):
    qwen3_5_hybrid.get_config("6")


def test_the_cache_holds_the_linear_state():
  mcfg = setup.model_config(qwen3_5_hybrid.get_config())
  short = memory.estimate_memory(mcfg, kv_batch=2, kv_len=1024).kv_cache
  long = memory.estimate_memory(mcfg, kv_batch=2, kv_len=2048).kv_cache
  # Only the 8 full-attention layers grow with the slots: 8 layers x 2 rows
  # x 1024 more slots x 4 kv heads x 256 x (k, v) x 2 B (bf16).
  attention = 8 * 2 * 1024 * 4 * 256 * 2 * 2
  assert long - short == attention
  # The 24 linear layers' states, whatever the slots: per row a float32
  # [32, 128, 128] delta-rule state and bf16 conv states of the last 3
  # inputs of q, k (16 x 128 each) and v (32 x 128).
  assert short - attention == 24 * 2 * (32 * 128 * 128 * 4 +
                                        (2 * 16 + 32) * 128 * 3 * 2)


@pytest.mark.skipif(not _OK, reason=f"cannot compile for TPUs here: {_WHY}")
@pytest.mark.slow
@pytest.mark.multiprocess
def test_one_pattern_repeat_compiles_for_a_v5p_64():
  # 4 layers (one scanned repeat) at full width, vocabulary 1,024, 128
  # tokens (two 64-token chunks of the delta rule): the same program's
  # shapes and sharding as the whole model's.
  got, reports = fresh_process.aot(
      "--config=configs/qwen3_5_hybrid.py:4", "--topology=v5p-64",
      "--config.model.vocab_size=1024", "--config.train.batch_size=16",
      "--config.train.max_seq_len=128", "--config.sampler.max_total_tokens=128",
      "--config.sampler.max_new_tokens=64",
      "--programs=sao_step,sampler_decode", "--nosearch_slots")
  assert got.returncode == 0, got.stderr[-3000:]
  step, decode = reports["sao_step"], reports["sampler_decode"]
  assert step["fits"] and step["devices"] == 16, step
  # The sampler over its 2 chips of each host (sampler.mesh's default with
  # a split), tensor parallel.
  assert decode["fits"] and decode["devices"] == 2, decode
  assert decode["mesh"] == {"data": 1, "fsdp": 1, "tensor": 2}, decode
  for r in (step, decode):
    assert 0 < r["peak_bytes"] <= r["hbm_bytes"], r
