"""Gemma 3 text (`Gemma3ForCausalLM`, model_type gemma3_text).

Interleaved local (sliding-window) and global layers (`layer_types`), each
kind with its own RoPE base (`local_rope_theta` / `rope_theta` and scaling),
(1 + w) RMSNorm with norms after attention and after the MLP
(`norm_style='gemma'`), a GELU-tanh gated MLP, embeddings scaled by
sqrt(hidden_size), q/k norms, tied embeddings and scores scaled by
query_pre_attn_scalar^-1/2. The layers are the shared ones
(models/layers/); this module converts configs and names the four
norms' tensors. docs/design/extending.md.
"""

from __future__ import annotations

from typing import Any, Mapping

from sao_jax.models.families import common
from sao_jax.models.families import registry
from sao_jax.models.families.errors import UnsupportedConfigError
from sao_jax.models.layers import rope as rope_lib

ARCH = "Gemma3ForCausalLM"
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
# A Gemma block's four norms (ours, HF), in block order.
NORM_NAMES = (("attn_norm", "input_layernorm"),
              ("post_attn_norm", "post_attention_layernorm"),
              ("mlp_norm", "pre_feedforward_layernorm"),
              ("post_mlp_norm", "post_feedforward_layernorm"))


def _layer_types(hf: Mapping[str, Any], n: int) -> tuple[str, ...]:
  types = hf.get("layer_types")
  if types:
    return tuple(types)
  pattern = int(hf.get("sliding_window_pattern") or
                hf.get("_sliding_window_pattern") or 6)
  return tuple("full_attention" if (i + 1) % pattern == 0 else
               "sliding_attention" for i in range(n))


def _rope(hf: Mapping[str, Any]) -> tuple[float, Any, float]:
  """(global theta, global scaling, local theta) from either HF layout."""
  params = hf.get("rope_parameters") or {}
  if "full_attention" in params:  # transformers 5: one entry per kind.
    full = dict(params["full_attention"])
    local = dict(params.get("sliding_attention") or {})
    local_theta = float(local.pop("rope_theta", 10000.0))
    if local.get("rope_type", "default") != "default":
      raise UnsupportedConfigError(
          f"Gemma 3 sliding-layer RoPE scaling {local} is not supported.")
  else:  # transformers 4: rope_theta, rope_local_base_freq, rope_scaling.
    full = dict(hf.get("rope_scaling") or {})
    full.setdefault("rope_theta", hf.get("rope_theta", 1000000.0))
    local_theta = float(hf.get("rope_local_base_freq", 10000.0))
  theta = float(full.pop("rope_theta", 1000000.0))
  full.pop("type", None)
  try:
    scaling = rope_lib.normalize_scaling(full)
  except ValueError as e:
    raise UnsupportedConfigError(f"Gemma 3 RoPE scaling: {e}") from e
  return theta, scaling, local_theta


def from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """Every `ModelConfig` field of a HF Gemma 3 text config."""
  act = hf.get("hidden_activation") or hf.get("hidden_act") or (
      "gelu_pytorch_tanh")
  if act not in GELU_TANH:
    raise UnsupportedConfigError(
        f"Gemma 3 hidden_activation={act!r}; only {GELU_TANH} are supported.")
  for key in ("final_logit_softcapping", "attn_logit_softcapping"):
    if hf.get(key) is not None:
      raise UnsupportedConfigError(
          f"Gemma 3 {key}={hf[key]} is not supported (softcapping).")
  if hf.get("use_bidirectional_attention") or hf.get("attention_bias"):
    raise UnsupportedConfigError(
        "Gemma 3 use_bidirectional_attention / attention_bias is not "
        "supported.")
  n = int(hf["num_hidden_layers"])
  theta, scaling, local_theta = _rope(hf)
  heads = int(hf["num_attention_heads"])
  head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
  return dict(
      vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
      intermediate_size=int(hf["intermediate_size"]), num_layers=n,
      num_heads=heads,
      num_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=head_dim, rope_theta=theta, rope_scaling=scaling,
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qk_norm=True,
      tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
      sliding_window=int(hf.get("sliding_window") or 0),
      layer_types=_layer_types(hf, n), local_rope_theta=local_theta,
      query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or
                                  head_dim),
      norm_style="gemma", mlp_activation="gelu_tanh")


def _number(x: float) -> int | float:
  """An int where x is whole (transformers types query_pre_attn_scalar int)."""
  return int(x) if float(x).is_integer() else float(x)


def to_hf(cfg: Any) -> dict[str, Any]:
  """The HF `config.json` dict of a Gemma-style `ModelConfig` `cfg`."""
  if (cfg.norm_style, cfg.mlp_activation) != ("gemma", "gelu_tanh") or (
      not cfg.qk_norm or cfg.qkv_bias or cfg.moe is not None or
      cfg.rotary_dim or cfg.nope_layers or cfg.qk_norm_full_width or
      cfg.mla or cfg.grouped or cfg.final_logit_softcapping):
    raise UnsupportedConfigError(
        "Gemma3ForCausalLM needs norm_style='gemma', mlp_activation="
        "'gelu_tanh', per-head q/k norms, no biases, no experts and RoPE on "
        "every "
        "channel of every layer; "
        f"export as {cfg.hf_architecture()}.")
  types = list(cfg.layer_types) or [
      "sliding_attention" if cfg.sliding_window else "full_attention"
  ] * cfg.num_layers
  return {
      **gemma_to_hf(cfg, ARCH, "gemma3_text", types),
      "query_pre_attn_scalar": _number(cfg.query_pre_attn_scalar or
                                       cfg.head_dim),
      "final_logit_softcapping": None, "attn_logit_softcapping": None,
      "attention_bias": False,
  }


def gemma_to_hf(cfg: Any, arch: str, model_type: str,
                types: list[str]) -> dict[str, Any]:
  """The config.json keys Gemma 3 and 4 share: Llama's sizes, GeGLU, and
  RoPE per layer kind (the sliding layers' plain, at local_rope_theta)."""
  out = common.base_to_hf(cfg, arch, model_type)
  for key in ("hidden_act", "rope_theta", "max_position_embeddings"):
    out.pop(key, None)
  return {**out, "hidden_activation": "gelu_pytorch_tanh",
          "rope_parameters": {
              "full_attention": common.rope_parameters(cfg),
              "sliding_attention": {
                  "rope_type": "default",
                  "rope_theta": cfg.local_rope_theta or cfg.rope_theta}},
          "sliding_window": cfg.sliding_window or None, "layer_types": types}


FAMILY = registry.register(registry.Family(
    architecture=ARCH, model_type="gemma3_text", from_hf=from_hf, to_hf=to_hf,
    claims=lambda cfg: cfg.norm_style == "gemma", priority=10,
    norm_names=NORM_NAMES))
