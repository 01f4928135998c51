r"""Qwen3-30B-A3B at real size, for checking against TPU slices (shapes).

The architecture of Qwen3-30B-A3B (its config.json: 48 layers, every one a
mixture of experts, 128 experts top-8 with softmax routing and renormalised
weights, no shared expert; ``models/hf.py`` loads the checkpoint with
``--config.model.init_from=DIR``) at 8k tokens per trajectory on a v5p-64:
bfloat16 compute with remat, the state FSDP-sharded (the experts over the same
axis: ``sharding.DEFAULT_RULES`` maps 'expert' to 'fsdp') over the trainer's 16
chips (0, 1 of each host, one row of the batch each), the sampler over chips
2, 3 of each host (``sampler.mesh``'s default with a split). Routing replay
(R3) on, as a MoE run would train. Master weights and AdamW moments are
bfloat16 (chosen when the sampler held the policy unsharded on one chip in
``model.param_dtype``: 30.5B float32 parameters, 122 GB, fit no v5p chip). Check it before renting the slice:

  python -m sao_jax.aot --config=configs/qwen3_30b_a3b.py --topology=v5p-64

What fits where is in BENCHMARKS.md ("TPU slices on paper", Qwen3-30B-A3B):
this config's SAO step 88.3 of 95 GiB a trainer chip, the sampler's prefill
66.7 GiB on chip 2 alone (``--config.sampler.mesh.tensor=1``).
"""

import ml_collections

from configs import base
from configs import qwen2_5_7b


def qwen3_moe(m: ml_collections.ConfigDict, *, hidden_size: int,
              intermediate_size: int, num_layers: int, num_heads: int,
              expert_size: int) -> None:
  """Sets ``m`` (config.model) to a Qwen3-MoE checkpoint's architecture
  (configs/qwen3_235b_a22b.py too): every layer 128 experts top-8 with
  softmax routing and renormalised weights, 4 KV heads of 128, q/k norms,
  routing replay on; the sizes its config.json gives."""
  m.vocab_size = 151936
  m.hidden_size = hidden_size
  m.intermediate_size = intermediate_size  # Dense MLP (no layer is dense).
  m.num_layers = num_layers
  m.num_heads = num_heads
  m.num_kv_heads = 4
  m.head_dim = 128
  m.rope_theta = 1000000.0
  m.rms_norm_eps = 1e-6
  m.qkv_bias = False
  m.qk_norm = True
  m.tie_embeddings = False
  m.moe.num_experts = 128
  m.moe.top_k = 8
  m.moe.intermediate_size = expert_size
  m.moe.router = "softmax"
  m.moe.norm_topk_prob = True
  m.router_aux_loss_coef = 0.001
  m.routing_replay = "rollout"


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  qwen3_moe(config.model, hidden_size=2048, intermediate_size=6144,
            num_layers=48, num_heads=32, expert_size=768)
  # Master weights, AdamW moments, sampler copy.
  config.model.param_dtype = "bfloat16"
  # 8k tokens x 785 B of routing record a token: a bigger ring.
  return qwen2_5_7b.v5p_layout(config, 8192, ring_bytes=1024 * 2**20)
