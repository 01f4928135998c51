r"""Qwen3-235B-A22B at real size, for checking against TPU slices (shapes).

The architecture of Qwen3-235B-A22B (its config.json: 94 layers, every one
a mixture of experts, 128 experts top-8 with softmax routing and
renormalised weights, 64 heads over 4 KV heads; ``models/hf.py`` loads the
checkpoint with ``--config.model.init_from=DIR``) at 8k tokens per
trajectory on a v5p-256: bfloat16 compute over float32 master weights with
remat, the state FSDP-sharded (the experts over the same axis) over the
trainer's 64 chips (0, 1 of each of 32 hosts, one row of the batch each),
routing replay (R3) on, each host's sampler over its chips 2, 3. Its 235B
bfloat16 weights (470 GB) fit no host's sampler block: a host has four 95 GB
chips; a sampler sharded across hosts is not built. Check it before renting
the slice:

  python -m sao_jax.aot --config=configs/qwen3_235b_a22b.py --topology=v5p-256

What fits where is in BENCHMARKS.md ("TPU slices on paper").
"""

import ml_collections

from configs import base
from configs import qwen2_5_7b
from configs import qwen3_30b_a3b


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  qwen3_30b_a3b.qwen3_moe(config.model, hidden_size=4096,
                          intermediate_size=12288, num_layers=94,
                          num_heads=64, expert_size=1536)
  config.model.param_dtype = "float32"  # Master weights and AdamW moments.
  # 8k tokens x 1.5 kB of routing record a token: a bigger ring.
  return qwen2_5_7b.v5p_layout(config, 8192, ring_bytes=2048 * 2**20,
                               slice_name="v5p-256")
