"""Phi-3 / Phi-4 (`Phi3ForCausalLM`, model_type phi3).

Llama's layers under other tensor names: q/k/v are one fused
`self_attn.qkv_proj` and the MLP's gate and up one `mlp.gate_up_proj` (rows
in that order; `registry.Family.fused`, read and written as row ranges of
our separate parameters by models/hf_layout.py). Phi-4-mini rotates part
of each head (`partial_rotary_factor` -> `ModelConfig.rotary_dim`); the long-
context checkpoints use LongRoPE (`rope_type` 'longrope', legacy 'su':
short/long per-frequency factors, models/layers/rope.py), whose
`original_max_position_embeddings` Phi-3 keeps at the top level of
config.json; one `sliding_window` for every layer (Phi-3-mini).
docs/design/extending.md "A model family".
"""

from __future__ import annotations

from typing import Any, Mapping

from sao_jax.models.families import common
from sao_jax.models.families import registry
from sao_jax.models.families.errors import UnsupportedConfigError

ARCH = "Phi3ForCausalLM"
FUSED = (("self_attn.qkv_proj",
          ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
         ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")))
# Rope types transformers' Phi3Config reads as longrope.
_LONGROPE_ALIASES = ("su", "yarn", "longrope")


def _rope_config(hf: Mapping[str, Any]) -> dict[str, Any]:
  """`hf` with its RoPE fields as transformers' Phi3Config reads them."""
  hf = dict(hf)
  key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
  rope = dict(hf.get(key) or {})
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type in _LONGROPE_ALIASES:
    rope.pop("type", None)
    rope["rope_type"] = "longrope"
    original = hf.get("original_max_position_embeddings")
    if original:  # Phi-3's top-level value wins, as in transformers.
      rope["original_max_position_embeddings"] = int(original)
  elif rope_type != "default":
    raise UnsupportedConfigError(
        f"Phi-3 rope_type={rope_type!r}: transformers' Phi3Config takes only "
        "'default' and 'longrope' (or its aliases 'su', 'yarn').")
  hf[key] = rope or None
  return hf


def from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """Every `ModelConfig` field of a HF Phi-3 config."""
  common.refuse(hf, "Phi-3", "attention_bias", "mlp_bias")
  hf = _rope_config(hf)
  base = common.base_from_hf(hf, partial_ok=True)
  partial = common.rope_from_hf(hf, partial_ok=True)[2]
  rotary = int(base["head_dim"] * partial)
  window = hf.get("sliding_window")
  if window is not None and int(window) < 1:
    raise UnsupportedConfigError(
        f"Phi-3 sliding_window={window} must be None or >= 1.")
  return {**base, "qkv_bias": False, "qk_norm": False,
          "sliding_window": int(window or 0),
          "rotary_dim": 0 if rotary == base["head_dim"] else rotary}


def to_hf(cfg: Any) -> dict[str, Any]:
  """The HF Phi-3 config.json dict of `cfg`."""
  common.check_export(cfg, ARCH, sliding=True, partial_rotary=True)
  out = common.base_to_hf(cfg, ARCH, "phi3")
  rope = {**common.rope_parameters(cfg), "partial_rotary_factor":
          (cfg.rotary_dim or cfg.head_dim) / cfg.head_dim}
  if rope["rope_type"] not in ("default", "longrope"):
    raise UnsupportedConfigError(
        f"Phi3ForCausalLM cannot express rope_type={rope['rope_type']!r} "
        f"(only 'default' and 'longrope'); export as "
        f"{cfg.hf_architecture()}.")
  original = rope.get("original_max_position_embeddings")
  if original:
    out["original_max_position_embeddings"] = original
  # No pad id: Phi3Config's default (32000) must lie in the vocabulary; the
  # tokenizer's files carry the real one.
  return {**out, "rope_parameters": rope, "pad_token_id": None,
          "sliding_window": cfg.sliding_window or None}


def _claims(cfg: Any) -> bool:
  """Llama-like dense configs with partial rotary or LongRoPE."""
  longrope = dict(cfg.rope_scaling).get("rope_type") == "longrope"
  plain = cfg.moe is None and not (cfg.qk_norm or cfg.qkv_bias)
  return plain and (bool(cfg.rotary_dim) or longrope)


FAMILY = registry.register(registry.Family(
    architecture=ARCH, model_type="phi3", from_hf=from_hf, to_hf=to_hf,
    claims=_claims, priority=15, fused=FUSED))
