"""DeepSeek-V3 (`DeepseekV3ForCausalLM`, model_type deepseek_v3; Kimi K2).

Multi-head latent attention (`ModelConfig.kv_lora_rank` and friends,
models/layers/mla.py: a low-rank key/value latent the KV cache holds, a
decoupled RoPE key shared by the heads, an optional query bottleneck) over
GLM-4.5's MoE: sigmoid routing with a score-correction bias, expert groups,
routed scaling and shared experts, after `first_k_dense_replace` dense
layers. DeepSeek lays each head's RoPE channels out in interleaved pairs
(`rope_interleave`); the import de-interleaves those rows of the weights so
our rotate_half RoPE applies, the export interleaves them back
(models/hf_layout.py). The multi-token-prediction layers
(`num_nextn_predict_layers`, after the decoder's) are skipped on import.
docs/design/extending.md "A model family".
"""

from __future__ import annotations

from typing import Any, Mapping

from sao_jax.models.families import common
from sao_jax.models.families import registry
from sao_jax.models.families.errors import UnsupportedConfigError

ARCH = "DeepseekV3ForCausalLM"


def from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """Every `ModelConfig` field of a HF DeepSeek-V3 config (`moe` a dict)."""
  common.refuse(hf, "DeepSeek-V3", "attention_bias")
  if not hf.get("rope_interleave", True):
    raise UnsupportedConfigError(
        "DeepSeek-V3 rope_interleave=False is not supported (every DeepSeek-V3 "
        "checkpoint interleaves its RoPE channels).")
  heads = int(hf["num_attention_heads"])
  kv_heads = int(hf.get("num_key_value_heads") or heads)
  if kv_heads != heads:
    raise UnsupportedConfigError(
        f"DeepSeek-V3 num_key_value_heads={kv_heads} must equal "
        f"num_attention_heads={heads} (MLA expands every head from the "
        "latent).")
  rope_dim = int(hf["qk_rope_head_dim"])
  moe = dict(
      num_experts=int(hf["n_routed_experts"]),
      top_k=int(hf["num_experts_per_tok"]),
      intermediate_size=int(hf["moe_intermediate_size"]),
      router="sigmoid", norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
      n_group=int(hf.get("n_group") or 1),
      topk_group=int(hf.get("topk_group") or 1),
      routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
      n_shared_experts=int(hf.get("n_shared_experts") or 0))
  return {**common.base_from_hf(hf), "num_kv_heads": heads,
          "head_dim": int(hf["qk_nope_head_dim"]) + rope_dim,
          "qkv_bias": False, "qk_norm": False, "moe": moe,
          "first_dense_layers": int(hf.get("first_k_dense_replace") or 0),
          "kv_lora_rank": int(hf["kv_lora_rank"]),
          "q_lora_rank": int(hf.get("q_lora_rank") or 0),
          "qk_rope_head_dim": rope_dim, "v_head_dim": int(hf["v_head_dim"])}


def to_hf(cfg: Any) -> dict[str, Any]:
  """The HF DeepSeek-V3 config.json dict of `cfg`."""
  common.check_export(cfg, ARCH, router="sigmoid", mla=True)
  return {
      **common.base_to_hf(cfg, ARCH, "deepseek_v3"),
      "head_dim": cfg.qk_rope_head_dim,
      "qk_nope_head_dim": cfg.head_dim - cfg.qk_rope_head_dim,
      "qk_rope_head_dim": cfg.qk_rope_head_dim, "v_head_dim": cfg.v_head_dim,
      "kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank or None,
      "rope_interleave": True, "attention_bias": False,
      **common.deepseek_moe_to_hf(cfg),
  }


def _mtp_layers(hf: Mapping[str, Any]) -> tuple[str, ...]:
  """The multi-token-prediction layers' tensor prefixes (after the
  decoder's `num_hidden_layers`)."""
  n = int(hf["num_hidden_layers"])
  return tuple(f"model.layers.{i}." for i in range(
      n, n + int(hf.get("num_nextn_predict_layers") or 0)))


FAMILY = registry.register(registry.Family(
    architecture=ARCH, model_type="deepseek_v3", from_hf=from_hf, to_hf=to_hf,
    claims=lambda cfg: cfg.mla, priority=-1, moe_router="sigmoid",
    skipped=_mtp_layers))
