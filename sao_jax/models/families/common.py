"""HF config fields every Llama-like family shares (docs/design/extending.md "A
model family").

`base_from_hf` / `base_to_hf` convert the fields of a decoder with RMSNorm,
RoPE, GQA and a gated MLP; `check_export` refuses a `ModelConfig` with a
feature the target architecture cannot express. Family modules add their own
fields on top. `cfg` is a `ModelConfig` (not imported: config.py imports this
package).
"""

from __future__ import annotations

from typing import Any, Mapping

from sao_jax.models.families.errors import UnsupportedConfigError
from sao_jax.models.layers import rope as rope_lib


def rope_from_hf(hf: Mapping[str, Any],
                 partial_ok: bool = False) -> tuple[float, Any, float]:
  """(rope_theta, rope_scaling, partial_rotary_factor) from transformers 5
  (`rope_parameters`) or 4 (`rope_theta`, `rope_scaling`) layouts."""
  rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  if rope_type in ("dynamic", "yarn", "longrope") and hf.get(
      "max_position_embeddings"):
    rope.setdefault("max_position_embeddings", hf["max_position_embeddings"])
  partial = float(rope.pop("partial_rotary_factor", None) or 1.0)
  if partial != 1.0 and not partial_ok:
    raise UnsupportedConfigError(
        "partial_rotary_factor != 1 (RoPE on part of a head) is only "
        "supported for Glm4MoeForCausalLM.")
  try:
    scaling = rope_lib.normalize_scaling(rope)
  except ValueError as e:
    raise UnsupportedConfigError(f"RoPE scaling: {e}") from e
  return float(theta), scaling, partial


def base_from_hf(hf: Mapping[str, Any],
                 partial_ok: bool = False) -> dict[str, Any]:
  """The shared `ModelConfig` fields of a Llama-like HF config."""
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise UnsupportedConfigError(
        f"hidden_act={act!r}; only 'silu' is supported.")
  theta, scaling, _ = rope_from_hf(hf, partial_ok)
  heads = int(hf["num_attention_heads"])
  return dict(
      vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
      intermediate_size=int(hf["intermediate_size"]),
      num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
      rope_theta=theta, rope_scaling=scaling,
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def refuse(hf: Mapping[str, Any], family: str, *keys: str) -> None:
  """UnsupportedConfigError if any of the boolean HF `keys` is set."""
  for key in keys:
    if hf.get(key, False):
      raise UnsupportedConfigError(f"{family} {key}=True is not supported.")


def rope_parameters(cfg: Any) -> dict[str, Any]:
  """HF `rope_parameters` (max_position_embeddings is a top-level key)."""
  params = {k: v for k, v in cfg.rope_scaling
            if k != "max_position_embeddings"}
  params.setdefault("rope_type", "default")
  return {**params, "rope_theta": cfg.rope_theta}


def base_to_hf(cfg: Any, arch: str, model_type: str) -> dict[str, Any]:
  """The shared config.json keys of `cfg` as `arch`."""
  out = {
      "architectures": [arch], "model_type": model_type,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size,
      "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "hidden_act": "silu", "rms_norm_eps": cfg.rms_norm_eps,
      "rope_theta": cfg.rope_theta, "rope_parameters": rope_parameters(cfg),
      "tie_word_embeddings": cfg.tie_embeddings,
      "torch_dtype": cfg.param_dtype, "dtype": cfg.param_dtype,
  }
  max_pos = dict(cfg.rope_scaling).get("max_position_embeddings")
  if max_pos:
    out["max_position_embeddings"] = max_pos
  return out


def deepseek_moe_to_hf(cfg: Any) -> dict[str, Any]:
  """The config.json keys of a DeepSeek-style MoE (sigmoid routing by groups,
  routed scaling, shared experts after dense first layers), as DeepSeek-V3
  and GLM-4.5 spell them."""
  moe = cfg.moe
  return {
      "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
      "moe_intermediate_size": moe.intermediate_size,
      "norm_topk_prob": moe.norm_topk_prob, "n_group": moe.n_group,
      "topk_group": moe.topk_group,
      "routed_scaling_factor": moe.routed_scaling_factor,
      "n_shared_experts": moe.n_shared_experts,
      "first_k_dense_replace": cfg.first_dense_layers,
      "num_nextn_predict_layers": 0,
  }


def check_export(cfg: Any, arch: str, *, qkv_bias: tuple[bool, ...] = (False,),
                 qk_norm: tuple[bool, ...] = (False,), sliding: bool = False,
                 router: str | None = None, partial_rotary: bool = False,
                 nope: bool = False, norm_style: str = "llama",
                 full_width_qk: bool = False, layer_types: bool = False,
                 mla: bool = False, hybrid: bool = False,
                 notes: Mapping[str, str] | None = None) -> None:
  """Refuses what `arch` (a Llama-like family) cannot express in `cfg`.

  Args:
    cfg: The `ModelConfig`.
    arch: The target HF architecture (named in the error).
    qkv_bias: The `qkv_bias` values `arch` can hold.
    qk_norm: The `qk_norm` values it can hold.
    sliding: Whether it has one `sliding_window` for every layer.
    router: The MoE router it has (None: a dense model).
    partial_rotary: Whether it can rotate part of a head (`rotary_dim`).
    nope: Whether it can leave RoPE out of some layers (`nope_layers`).
    norm_style: Its blocks' `norm_style` ('llama' or 'olmo'; Gemma 3
      checks its own).
    full_width_qk: Whether its q/k norms span all heads (OLMo 2/3; then
      `qk_norm_full_width` must be set).
    layer_types: Whether it mixes sliding and full layers (`layer_types`,
      `local_rope_theta`).
    mla: Whether its attention is multi-head latent attention (then
      `kv_lora_rank` must be set).
    hybrid: Whether it has Qwen3.5's gated attention and linear-attention
      layers (`attn_output_gate`, 'linear_attention' layer_types).
    notes: Field -> why, added to that field's error.
  """
  other = (cfg.norm_style != norm_style or cfg.mlp_activation != "silu" or
           cfg.query_pre_attn_scalar or cfg.qk_norm_full_width != full_width_qk
           or (not layer_types and (cfg.layer_types or cfg.local_rope_theta))
           or (not hybrid and (cfg.attn_output_gate or cfg.hybrid))
           or cfg.global_head_dim or cfg.global_kv_heads
           or cfg.attention_k_eq_v or cfg.final_logit_softcapping)
  if other:
    raise UnsupportedConfigError(
        f"{arch} cannot express norm_style={cfg.norm_style!r}, mlp_activation="
        f"{cfg.mlp_activation!r}, qk_norm_full_width="
        f"{cfg.qk_norm_full_width}, query_pre_attn_scalar, layer_types, "
        "local_rope_theta, attn_output_gate or Gemma 4's global_head_dim, "
        "global_kv_heads, attention_k_eq_v and final_logit_softcapping as "
        "this config sets them (Gemma 3/4, OLMo 2/3, Qwen3.5); "
        f"export as {cfg.hf_architecture()}.")
  cfg_router = cfg.moe.router if cfg.moe is not None else None
  problems = (("sliding_window", cfg.sliding_window,
               bool(cfg.sliding_window) and not sliding),
              ("moe", cfg.moe, cfg_router != router),
              ("qkv_bias", cfg.qkv_bias, cfg.qkv_bias not in qkv_bias),
              ("qk_norm", cfg.qk_norm, cfg.qk_norm not in qk_norm),
              ("rotary_dim", cfg.rotary_dim,
               bool(cfg.rotary_dim) and not partial_rotary),
              ("nope_layers", cfg.nope_layers,
               bool(cfg.nope_layers) and not nope),
              ("kv_lora_rank", cfg.kv_lora_rank, cfg.mla != mla))
  for name, value, bad in problems:
    if bad:
      note = (notes or {}).get(name)
      other = cfg.hf_architecture()
      raise UnsupportedConfigError(
          f"{arch} cannot express {name}={value}"
          + (f" ({note})" if note else "")
          + (f"; export as {other} instead." if other != arch else
             "; no supported HF architecture holds it together with this "
             "config's other fields."))
