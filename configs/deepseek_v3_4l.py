r"""DeepSeek-V3's shapes cut to 4 layers, for checking against TPU slices.

DeepSeek-V3's config.json (transformers' DeepseekV3Config defaults): hidden
7168, 128 heads of multi-head latent attention (a 512-wide key/value latent
and a 64-wide RoPE key cached per token, a 1536-wide query bottleneck,
q/k heads 128 + 64, values 128), vocabulary 129,280, the first 3 layers
dense (MLP 18,432), the rest 256 routed experts (width 2048) top-8 in 8
groups (4 used) with sigmoid scores, a score-correction bias, routed scaling
2.5 and one shared expert; YaRN RoPE (factor 40 over 4096). Here 4 of its 61
layers: the 3 dense ones and one MoE layer (every later layer is alike), at
8k tokens per trajectory on a v5p-64 laid out as configs/qwen3_30b_a3b.py
(bf16 master weights and moments: the sampler holds the policy unsharded on
one chip). Check it before renting the slice:

  python -m sao_jax.aot --config=configs/deepseek_v3_4l.py --topology=v5p-64

What fits is in BENCHMARKS.md ("TPU slices on paper", DeepSeek-V3 cut to 4
layers).
"""

import ml_collections

from configs import base
from configs import qwen2_5_7b


def get_config() -> ml_collections.ConfigDict:
  config = base.get_config()
  length = 8192

  m = config.model  # DeepSeek-V3's config.json, 4 of 61 layers.
  m.vocab_size = 129280
  m.hidden_size = 7168
  m.intermediate_size = 18432
  m.num_layers = 4
  m.num_heads = 128
  m.num_kv_heads = 128
  m.head_dim = 192  # qk_nope_head_dim 128 + qk_rope_head_dim 64.
  m.kv_lora_rank = 512
  m.q_lora_rank = 1536
  m.qk_rope_head_dim = 64
  m.v_head_dim = 128
  m.rope_theta = 10000.0
  m.rope_scaling = ml_collections.ConfigDict({
      "rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
      "mscale": 1.0, "mscale_all_dim": 1.0,
      "original_max_position_embeddings": 4096,
      "max_position_embeddings": 163840})
  m.rms_norm_eps = 1e-6
  m.tie_embeddings = False
  m.first_dense_layers = 3
  m.moe.num_experts = 256
  m.moe.top_k = 8
  m.moe.intermediate_size = 2048
  m.moe.router = "sigmoid"
  m.moe.norm_topk_prob = True
  m.moe.n_group = 8
  m.moe.topk_group = 4
  m.moe.routed_scaling_factor = 2.5
  m.moe.n_shared_experts = 1
  m.router_aux_loss_coef = 0.0  # DeepSeek-V3 balances by the bias, no loss.
  m.routing_replay = "rollout"
  m.param_dtype = "bfloat16"  # Master weights, AdamW moments, sampler copy.

  return qwen2_5_7b.v5p_layout(config, length, ring_bytes=1024 * 2**20)
