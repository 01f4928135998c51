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


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  length = 8192

  m = config.model  # Qwen3-235B-A22B's config.json.
  m.vocab_size = 151936
  m.hidden_size = 4096
  m.intermediate_size = 12288  # Dense MLP width (no layer here is dense).
  m.num_layers = 94
  m.num_heads = 64
  m.num_kv_heads = 4
  m.head_dim = 128
  m.rope_theta = 1000000.0
  m.rms_norm_eps = 1e-6
  m.qkv_bias = False
  m.qk_norm = True
  m.tie_embeddings = False
  m.moe.num_experts = 128
  m.moe.top_k = 8
  m.moe.intermediate_size = 1536
  m.moe.router = "softmax"
  m.moe.norm_topk_prob = True
  m.router_aux_loss_coef = 0.001
  m.routing_replay = "rollout"
  m.param_dtype = "float32"  # Master weights and AdamW moments.

  # 8k tokens x 1.5 kB of routing record a token: a bigger ring.
  return qwen2_5_7b.v5p_layout(config, length, ring_bytes=2048 * 2**20,
                               slice_name="v5p-256")
