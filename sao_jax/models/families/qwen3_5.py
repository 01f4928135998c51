"""Qwen3.5 dense (`Qwen3_5ForCausalLM`, model_type qwen3_5_text): a hybrid
decoder.

Most layers are Gated DeltaNet linear attention (`layer_types`
'linear_attention', layers/linear_attention.py; HF `linear_attn.*`), every
`full_attention_interval`-th (default 4) a full-attention layer whose
q_proj also gives a per-head output gate (`attn_output_gate`), with
per-head q/k norms and RoPE on the first quarter of each head
(`partial_rotary_factor`). Every RMSNorm but the linear layers' gated one
is (1 + w) with w initialised to 0 (`norm_style='qwen3_5'`).
Text-only positions make its multimodal RoPE (`mrope_section`) the plain
one. docs/design/extending.md "A model family".
"""

from __future__ import annotations

from typing import Any, Mapping

from sao_jax.models.families import common
from sao_jax.models.families import registry
from sao_jax.models.families.errors import UnsupportedConfigError

ARCH = "Qwen3_5ForCausalLM"
MODEL_TYPE = "qwen3_5_text"
_LINEAR = ("linear_num_key_heads", "linear_num_value_heads",
           "linear_key_head_dim", "linear_value_head_dim",
           "linear_conv_kernel_dim")
# transformers' Qwen3_5TextConfig defaults of the keys a config may omit.
_DEFAULTS = {"linear_num_key_heads": 16, "linear_num_value_heads": 32,
             "linear_key_head_dim": 128, "linear_value_head_dim": 128,
             "linear_conv_kernel_dim": 4, "head_dim": 256,
             "rms_norm_eps": 1e-6}
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")


def _layer_types(hf: Mapping[str, Any]) -> tuple[str, ...]:
  n = int(hf["num_hidden_layers"])
  every = int(hf.get("full_attention_interval") or 4)
  types = tuple(hf.get("layer_types") or (
      "linear_attention" if (i + 1) % every else "full_attention"
      for i in range(n)))
  if len(types) != n or not set(types) <= {"linear_attention",
                                           "full_attention"}:
    raise UnsupportedConfigError(
        f"layer_types={list(types)} must name each of the {n} "
        "layers 'linear_attention' or 'full_attention'.")
  return types


def from_hf(hf: Mapping[str, Any], family: str = "Qwen3.5"
            ) -> dict[str, Any]:
  """Every `ModelConfig` field of a HF Qwen3.5 text config (the hybrid
  decoder's of a Qwen3-Next one)."""
  if hf.get("attention_bias", False):
    raise UnsupportedConfigError(
        f"{family} attention_bias=True is not supported.")
  hf = {**_DEFAULTS, **{k: v for k, v in hf.items() if v is not None}}
  rope = dict(hf.get("rope_parameters") or {})
  rope.setdefault("partial_rotary_factor",
                  hf.get("partial_rotary_factor", 0.25))
  for key in _MROPE_KEYS:  # One text position per token: plain RoPE.
    rope.pop(key, None)
  hf = {**hf, "rope_parameters": rope}
  base = common.base_from_hf(hf, partial_ok=True)
  partial = common.rope_from_hf(hf, partial_ok=True)[2]
  rotary = int(base["head_dim"] * partial)
  return {**base, "qkv_bias": False, "qk_norm": True,
          "attn_output_gate": True, "norm_style": "qwen3_5",
          "rotary_dim": 0 if rotary == base["head_dim"] else rotary,
          "layer_types": _layer_types(hf),
          **{k: int(hf[k]) for k in _LINEAR}}


def to_hf(cfg: Any, arch: str = ARCH, model_type: str = MODEL_TYPE,
          router: str | None = None) -> dict[str, Any]:
  """The HF Qwen3.5 config.json dict of `cfg` (or the hybrid decoder's
  keys as `arch`, whose MoE has `router`: Qwen3-Next)."""
  common.check_export(cfg, arch, qk_norm=(True,), norm_style="qwen3_5",
                      partial_rotary=True, layer_types=True, hybrid=True,
                      router=router)
  if not cfg.attn_output_gate or set(cfg.layer_types) - {
      "linear_attention", "full_attention"}:
    raise UnsupportedConfigError(
        f"{arch} needs attn_output_gate=True and layer_types of "
        "'linear_attention' / 'full_attention' only.")
  factor = (cfg.rotary_dim or cfg.head_dim) / cfg.head_dim
  out = common.base_to_hf(cfg, arch, model_type)
  return {**out, "attention_bias": False,
          "layer_types": list(cfg.layer_types) or ["full_attention"] * (
              cfg.num_layers),
          "rope_parameters": {**out["rope_parameters"],
                              "partial_rotary_factor": factor},
          **{k: getattr(cfg, k) for k in _LINEAR}}


# The linear layers' q, k, v input projections: one tensor, in that order.
FUSED = (("linear_attn.in_proj_qkv", tuple(
    f"linear_attn.in_proj_{p}" for p in "qkv")),)

FAMILY = registry.register(registry.Family(
    architecture=ARCH, model_type=MODEL_TYPE, from_hf=from_hf, to_hf=to_hf,
    claims=lambda cfg: cfg.norm_style == "qwen3_5", priority=10,
    fused=FUSED))
