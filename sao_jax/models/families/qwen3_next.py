"""Qwen3-Next (`Qwen3NextForCausalLM`, model_type qwen3_next): Qwen3.5's
hybrid decoder with Qwen's MoE.

The decoder is Qwen3.5's (families/qwen3_5.py): Gated DeltaNet linear
layers with a gated full-attention layer every `full_attention_interval`
(layers/linear_attention.py), (1 + w) norms, partial rotary. The
feed-forward is Qwen3-MoE's softmax top-k router (families/qwen3_moe.py)
plus one shared expert of `shared_expert_intermediate_size` scaled by a
per-token sigmoid gate (`MoeConfig.shared_expert_gate`;
layers/moe.py), after an optional dense prefix (`mlp_only_layers`). Its
linear layers fuse their input projections per key head: `in_proj_qkvz`
holds, for each of the `linear_num_key_heads` heads, its q, k, then its
value heads' v and z rows, `in_proj_ba` its value heads' b then a rows
(`registry.Family.fused` with row blocks). The multi-token-prediction
weights (`mtp.*`) are skipped on import. docs/design/extending.md "A model
family".
"""

from __future__ import annotations

from typing import Any, Mapping

from sao_jax.models.families import qwen3_5
from sao_jax.models.families import qwen3_moe
from sao_jax.models.families import registry
from sao_jax.models.families.errors import UnsupportedConfigError

ARCH = "Qwen3NextForCausalLM"
MODEL_TYPE = "qwen3_next"
# transformers' Qwen3NextConfig defaults of the MoE keys a config may omit.
_DEFAULTS = {"decoder_sparse_step": 1, "moe_intermediate_size": 512,
             "shared_expert_intermediate_size": 512, "num_experts_per_tok": 10,
             "num_experts": 512, "norm_topk_prob": True}


def from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """Every `ModelConfig` field of a HF Qwen3-Next config (`moe` a dict)."""
  hf = {**_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
  shared = int(hf["shared_expert_intermediate_size"])
  if int(hf["num_experts"]) < 1 or shared < 1:
    raise UnsupportedConfigError(
        f"Qwen3-Next num_experts={hf['num_experts']}, "
        f"shared_expert_intermediate_size={shared}: both must be >= 1 (a "
        "dense hybrid decoder is Qwen3_5ForCausalLM's).")
  routed = qwen3_moe.moe_from_hf(hf, "Qwen3-Next")
  moe = {**routed["moe"], "n_shared_experts": 1,
         "shared_intermediate_size": shared, "shared_expert_gate": True}
  return {**qwen3_5.from_hf(hf, "Qwen3-Next"), **routed, "moe": moe}


def to_hf(cfg: Any) -> dict[str, Any]:
  """The HF Qwen3-Next config.json dict of `cfg`."""
  out = qwen3_5.to_hf(cfg, ARCH, MODEL_TYPE, router="softmax")
  moe = cfg.moe
  if (moe.n_shared_experts != 1 or not moe.shared_expert_gate or
      moe.routed_scaling_factor != 1.0):
    raise UnsupportedConfigError(
        f"{ARCH} has one gated shared expert (n_shared_experts=1, "
        "shared_expert_gate=True) and no routed scaling; got "
        f"n_shared_experts={moe.n_shared_experts}, shared_expert_gate="
        f"{moe.shared_expert_gate}, routed_scaling_factor="
        f"{moe.routed_scaling_factor}.")
  return {**out, **qwen3_moe.moe_to_hf(cfg),
          "shared_expert_intermediate_size": moe.shared_width}


def _mtp(hf: Mapping[str, Any]) -> tuple[str, ...]:
  """The multi-token-prediction weights (the hub's checkpoints hold them)."""
  del hf
  return ("mtp.",)


# Per key head (linear_num_key_heads row blocks): q, k, v, z; then b, a.
FUSED = (("linear_attn.in_proj_qkvz", tuple(
    f"linear_attn.in_proj_{p}" for p in "qkvz"), "linear_num_key_heads"),
         ("linear_attn.in_proj_ba", ("linear_attn.in_proj_b",
                                     "linear_attn.in_proj_a"),
          "linear_num_key_heads"))

FAMILY = registry.register(registry.Family(
    architecture=ARCH, model_type=MODEL_TYPE, from_hf=from_hf, to_hf=to_hf,
    claims=lambda cfg: cfg.norm_style == "qwen3_5" and cfg.moe is not None,
    priority=-2, moe_router="softmax", fused=FUSED, skipped=_mtp))
