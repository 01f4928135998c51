"""Qwen3-MoE (`Qwen3MoeForCausalLM`, model_type qwen3_moe).

Qwen3's attention (q/k norms, no biases) with softmax top-k routed experts
(`MoeConfig`, models/layers/moe.py) after an optional dense prefix
(`mlp_only_layers` = [0, k)). The expert tensor names (`mlp.gate`,
`mlp.experts.{e}.*`) are the shared MoE names of models/hf_layout.py.
docs/design/extending.md "A model family".
"""

from __future__ import annotations

from typing import Any, Mapping

from sao_jax.models.families import common
from sao_jax.models.families import registry
from sao_jax.models.families.errors import UnsupportedConfigError

ARCH = "Qwen3MoeForCausalLM"


def moe_from_hf(hf: Mapping[str, Any], family: str = "Qwen3-MoE"
                ) -> dict[str, Any]:
  """`moe` (a dict of `MoeConfig` fields) and `first_dense_layers` of a
  Qwen-style MoE config (Qwen3-MoE, Qwen3-Next)."""
  n = int(hf["num_hidden_layers"])
  step = int(hf.get("decoder_sparse_step", 1))
  dense = sorted(int(i) for i in hf.get("mlp_only_layers") or [])
  if step != 1 or dense != list(range(len(dense))):
    raise UnsupportedConfigError(
        f"{family} decoder_sparse_step={step}, mlp_only_layers={dense}: only "
        "MoE layers after an optional dense prefix (step 1, mlp_only_layers "
        "= [0, ..., k-1]) are supported.")
  moe = dict(
      # transformers 5 writes num_local_experts; the hub's configs num_experts.
      num_experts=int(hf["num_experts"] if "num_experts" in hf
                      else hf["num_local_experts"]),
      top_k=int(hf["num_experts_per_tok"]),
      intermediate_size=int(hf["moe_intermediate_size"]),
      router="softmax", norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
  return {"moe": moe, "first_dense_layers": min(len(dense), n)}


def moe_to_hf(cfg: Any) -> dict[str, Any]:
  """The config.json keys of `cfg`'s Qwen-style MoE (`moe_from_hf`'s)."""
  moe = cfg.moe
  return {"num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
          "moe_intermediate_size": moe.intermediate_size,
          "norm_topk_prob": moe.norm_topk_prob, "decoder_sparse_step": 1,
          "mlp_only_layers": list(range(cfg.first_dense_layers))}


def from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """Every `ModelConfig` field of a HF Qwen3-MoE config (`moe` as a dict)."""
  if hf.get("use_sliding_window", False):
    raise UnsupportedConfigError(
        "Qwen3-MoE use_sliding_window=True is not supported.")
  common.refuse(hf, "Qwen3-MoE", "attention_bias")
  return {**common.base_from_hf(hf), "qkv_bias": False, "qk_norm": True,
          **moe_from_hf(hf)}


def to_hf(cfg: Any) -> dict[str, Any]:
  """The HF Qwen3-MoE config.json dict of `cfg`."""
  common.check_export(cfg, ARCH, qk_norm=(True,), router="softmax")
  moe = cfg.moe
  if moe.n_shared_experts or moe.routed_scaling_factor != 1.0:
    raise UnsupportedConfigError(
        "Qwen3MoeForCausalLM has no shared experts and no routed scaling.")
  return {**common.base_to_hf(cfg, ARCH, "qwen3_moe"), **moe_to_hf(cfg),
          "use_sliding_window": False, "attention_bias": False}


FAMILY = registry.register(registry.Family(
    architecture=ARCH, model_type="qwen3_moe", from_hf=from_hf, to_hf=to_hf,
    claims=lambda cfg: cfg.moe is not None and cfg.moe.router == "softmax",
    priority=0, moe_router="softmax"))
