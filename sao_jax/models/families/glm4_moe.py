"""GLM-4.5 (`Glm4MoeForCausalLM`, model_type glm4_moe), DeepSeek-V3-style
MoE without MLA.

Sigmoid grouped top-k routing with a score-correction bias, routed scaling
and shared experts (`MoeConfig`), the first `first_k_dense_replace` layers
dense, partial rotary (`rotary_dim`), optional q/k norms and qkv biases. The
expert tensor names are the shared MoE names of models/hf_layout.py.
docs/design/extending.md "A model family".
"""

from __future__ import annotations

from typing import Any, Mapping

from sao_jax.models.families import common
from sao_jax.models.families import registry

ARCH = "Glm4MoeForCausalLM"


def from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """Every `ModelConfig` field of a HF GLM-4.5 config (`moe` as a dict)."""
  base = common.base_from_hf(hf, partial_ok=True)
  partial = common.rope_from_hf(hf, partial_ok=True)[2]
  moe = dict(
      num_experts=int(hf["n_routed_experts"]),
      top_k=int(hf["num_experts_per_tok"]),
      intermediate_size=int(hf["moe_intermediate_size"]),
      router="sigmoid", norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
      n_group=int(hf.get("n_group", 1)),
      topk_group=int(hf.get("topk_group", 1)),
      routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
      n_shared_experts=int(hf.get("n_shared_experts", 0)))
  head_dim = base["head_dim"]
  rotary = int(head_dim * partial)
  return {**base, "qkv_bias": bool(hf.get("attention_bias", False)),
          "qk_norm": bool(hf.get("use_qk_norm", False)), "moe": moe,
          "first_dense_layers": int(hf.get("first_k_dense_replace", 0)),
          "rotary_dim": 0 if rotary == head_dim else rotary}


def to_hf(cfg: Any) -> dict[str, Any]:
  """The HF GLM-4.5 config.json dict of `cfg`."""
  common.check_export(cfg, ARCH, qkv_bias=(False, True),
                      qk_norm=(False, True), router="sigmoid",
                      partial_rotary=True)
  factor = (cfg.rotary_dim or cfg.head_dim) / cfg.head_dim
  return {
      **common.base_to_hf(cfg, ARCH, "glm4_moe"),
      "attention_bias": cfg.qkv_bias, "use_qk_norm": cfg.qk_norm,
      **common.deepseek_moe_to_hf(cfg),
      "rope_parameters": {**common.rope_parameters(cfg),
                          "partial_rotary_factor": factor},
  }


FAMILY = registry.register(registry.Family(
    architecture=ARCH, model_type="glm4_moe", from_hf=from_hf, to_hf=to_hf,
    claims=lambda cfg: cfg.moe is not None and cfg.moe.router == "sigmoid",
    priority=0, moe_router="sigmoid"))
