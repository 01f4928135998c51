r"""Llama-3.3-70B at real size, for checking against TPU slices (shapes).

The architecture of Llama-3.3-70B-Instruct (its config.json: 80 layers,
8,192 wide, 64 heads over 8 KV heads, llama3 RoPE scaling; ``models/hf.py``
loads the checkpoint with ``--config.model.init_from=DIR``) at 8k tokens per
trajectory on a v5p-128: bfloat16 compute over float32 master weights with
remat, the state (policy and critic, 1.6 TB with AdamW moments) FSDP-sharded
over the trainer's 32 chips (0, 1 of each of 16 hosts, one row of the batch
each), each host's sampler over its chips 2, 3 (tensor 2, bfloat16: 70.6 GB
of weights a chip, the rest for the KV cache). Check it before renting the
slice:

  python -m sao_jax.aot --config=configs/llama3_3_70b.py --topology=v5p-128

What fits where is in BENCHMARKS.md ("TPU slices on paper").
"""

import ml_collections

from configs import base
from configs import qwen2_5_7b


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  length = 8192

  m = config.model  # Llama-3.3-70B-Instruct's config.json.
  m.vocab_size = 128256
  m.hidden_size = 8192
  m.intermediate_size = 28672
  m.num_layers = 80
  m.num_heads = 64
  m.num_kv_heads = 8
  m.head_dim = 128
  m.rope_theta = 500000.0
  m.rope_scaling = ml_collections.ConfigDict({
      "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
  m.rms_norm_eps = 1e-5
  m.qkv_bias = False
  m.tie_embeddings = False
  m.param_dtype = "float32"  # Master weights and AdamW moments.

  return qwen2_5_7b.v5p_layout(config, length, ring_bytes=256 * 2**20,
                               slice_name="v5p-128")
