"""configs/qwen3_30b_a3b.py: Qwen3-30B-A3B's architecture, and its AOT batch.

The config has the checkpoint's size (30.5B parameters, 128 experts top-8 in
each of 48 layers); the ahead-of-time train batch of a MoE run carries the
recorded experts routing replay reads; and, where libtpu loads, the SAO step
at one of its layers (128 experts, top-8, sharded over the trainer's 16 chips)
compiles for a v5p-64 (the whole model's figures are BENCHMARKS.md's "TPU
slices on paper").
"""

import numpy as np
import pytest

import fresh_process

from configs import qwen3_30b_a3b
from sao_jax.aot import programs
from sao_jax.train import setup

# Asked of a child (libtpu never loads in pytest's process; the answer is
# cached per process, so test_aot's probe in the same worker is this one).
_OK, _WHY = fresh_process.libtpu_available()


def test_architecture_is_qwen3_30b_a3b():
  mcfg = setup.model_config(qwen3_30b_a3b.get_config())
  assert mcfg.num_params() == 30_532_122_624  # HF: 30.5B.
  assert (mcfg.num_layers, mcfg.num_moe_layers) == (48, 48)
  assert (mcfg.moe.num_experts, mcfg.moe.top_k,
          mcfg.moe.intermediate_size) == (128, 8, 768)
  assert mcfg.hf_architecture() == "Qwen3MoeForCausalLM"
  assert (mcfg.hidden_size, mcfg.num_heads, mcfg.num_kv_heads,
          mcfg.head_dim, mcfg.vocab_size) == (2048, 32, 4, 128, 151936)


def test_aot_batch_holds_the_recorded_experts():
  config = qwen3_30b_a3b.get_config()
  mcfg = setup.model_config(config)
  batch = programs.abstract_batch(config, None, mcfg)
  b, t = config.train.batch_size, config.train.max_seq_len
  assert batch["routed_experts"].shape == (b, t, 48, 8)
  assert batch["routed_experts"].dtype == np.int32
  assert batch["tokens"].shape == (b, t)
  dense = programs.abstract_batch(config, None, None)
  assert "routed_experts" not in dense


@pytest.mark.skipif(not _OK, reason=f"cannot compile for TPUs here: {_WHY}")
@pytest.mark.slow
@pytest.mark.multiprocess
def test_one_layer_compiles_for_a_v5p_64():
  # One scanned layer at 64 tokens, not two at 1,024: the same program's
  # shapes, sharding and expert layout (its TPU compile 55 -> 35 s from 256
  # tokens to 64, the command 100 -> 62 CPU-s).
  got, reports = fresh_process.aot(
      "--config=configs/qwen3_30b_a3b.py", "--topology=v5p-64",
      "--config.sampler.chips=v5p-64:2,3", "--config.train.batch_size=16",
      "--config.model.num_layers=1", "--config.train.max_seq_len=64",
      "--config.sampler.max_total_tokens=64",
      "--config.sampler.max_new_tokens=32", "--programs=sao_step")
  assert got.returncode == 0, got.stderr[-3000:]
  step = reports["sao_step"]
  assert step["fits"] and step["devices"] == 16, step
  assert 0 < step["peak_bytes"] <= step["hbm_bytes"], step
