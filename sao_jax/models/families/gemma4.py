"""Gemma 4 text (`Gemma4ForCausalLM`, model_type gemma4_text).

Gemma 3's interleaved sliding / full layers, four norms per block, GeGLU
MLP, sqrt(hidden_size) embeddings and q/k norms, with what Gemma 4 adds
(`norm_style='gemma4'`): RMSNorm * w (init 1), a scale-free norm on each
value head, scores q.k unscaled (q/k norms set their size), each block's
output times its `layer_scalar`, and `final_logit_softcapping`. Its global
('full_attention') layers have their own head width and key/value heads
(`global_head_dim`, `num_global_key_value_heads` or `per_layer_config`),
values from k_proj where `attention_k_eq_v`, and proportional RoPE on a
part of each head (layers/rope.py). The decoder scans repeats of the
layer pattern when the two kinds differ in shape (`ModelConfig.grouped`).
E2B / E4B's per-layer embeddings (`hidden_size_per_layer_input`;
layers/per_layer.py) and last layers attending with an earlier layer's
keys and values (`num_kv_shared_layers`, their MLPs twice as wide with
`use_double_wide_mlp`) are `ModelConfig` options too.

Refused (not in the shared layers yet, issue 41): the MoE block
(`enable_moe_block`: 26B-A4B), bidirectional attention and attention
biases. `Gemma4ForConditionalGeneration` (vision / audio towers) is another
architecture. docs/design/extending.md.
"""

from __future__ import annotations

from typing import Any, Mapping

from sao_jax.models.families import gemma3
from sao_jax.models.families import registry
from sao_jax.models.families.errors import UnsupportedConfigError
from sao_jax.models.layers import rope as rope_lib

ARCH = "Gemma4ForCausalLM"
MODEL_TYPE = "gemma4_text"
# transformers' Gemma4TextConfig defaults of keys a config may omit.
_GLOBAL_HEAD_DIM = 512
_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
         "full_attention": {"rope_type": "proportional",
                            "partial_rotary_factor": 0.25,
                            "rope_theta": 1e6}}
# config.json keys of what we cannot run: (transformers' default where the
# key is missing, the value meaning "off").
_REFUSED = {"enable_moe_block": (False, False),
            "use_bidirectional_attention": (None, None),
            "attention_bias": (False, False)}
_PLE = 256  # hidden_size_per_layer_input's default.


def _layer_types(hf: Mapping[str, Any], n: int) -> tuple[str, ...]:
  """As transformers: every 6th layer full by default, the last one full."""
  types = list(hf.get("layer_types") or [
      "full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
      for i in range(n)])
  if len(types) != n or not set(types) <= {"sliding_attention",
                                           "full_attention"}:
    raise UnsupportedConfigError(
        f"Gemma 4 layer_types={types} must name each of the {n} layers "
        "'sliding_attention' or 'full_attention'.")
  types[-1] = "full_attention"  # transformers forces it (with a warning).
  return tuple(types)


def _rope(hf: Mapping[str, Any]) -> tuple[float, Any, float]:
  """(full layers' theta, their scaling, sliding layers' theta)."""
  params = hf.get("rope_parameters") or _ROPE
  full = dict(params.get("full_attention") or _ROPE["full_attention"])
  local = dict(params.get("sliding_attention") or
               _ROPE["sliding_attention"])
  if local.get("rope_type", "default") != "default":
    raise UnsupportedConfigError(
        f"Gemma 4 sliding-layer RoPE {local} is not supported (plain only).")
  theta = float(full.pop("rope_theta", 1e6))
  if full.get("rope_type", "default") == "default":
    full = {}  # transformers' default RoPE reads no partial factor.
  try:
    scaling = rope_lib.normalize_scaling(full)
  except ValueError as e:
    raise UnsupportedConfigError(f"Gemma 4 RoPE scaling: {e}") from e
  return theta, scaling, float(local.get("rope_theta", 1e4))


def _global_dims(hf: Mapping[str, Any], types: tuple[str, ...],
                 head_dim: int, kv_heads: int) -> tuple[int, int]:
  """The full layers' (head_dim, kv heads): a saved `per_layer_config`, else
  `global_head_dim` and (with attention_k_eq_v) num_global_key_value_heads."""
  per_layer = hf.get("per_layer_config")
  if per_layer is None:
    kv = hf.get("num_global_key_value_heads") if hf.get(
        "attention_k_eq_v") else None
    return int(hf.get("global_head_dim") or _GLOBAL_HEAD_DIM), int(
        kv or kv_heads)
  overrides = {int(k): dict(v) for k, v in per_layer.items()}
  full = {tuple(sorted(overrides.get(i, {}).items()))
          for i, t in enumerate(types) if t == "full_attention"}
  sliding = [i for i, t in enumerate(types)
             if t == "sliding_attention" and overrides.get(i)]
  if len(full) != 1 or sliding or set(dict(*full)) - {
      "head_dim", "num_key_value_heads"}:
    raise UnsupportedConfigError(
        f"Gemma 4 per_layer_config={per_layer}: every full layer must "
        "override head_dim / num_key_value_heads alike and no sliding layer "
        "anything.")
  one = dict(*full)
  return int(one.get("head_dim", head_dim)), int(
      one.get("num_key_value_heads", kv_heads))


def from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """Every `ModelConfig` field of a HF Gemma 4 text config."""
  act = hf.get("hidden_activation") or "gelu_pytorch_tanh"
  if act not in gemma3.GELU_TANH:
    raise UnsupportedConfigError(
        f"Gemma 4 hidden_activation={act!r}; only {gemma3.GELU_TANH}.")
  for key, (default, off) in _REFUSED.items():
    value = hf.get(key, default)
    if value not in (off, None):  # None: off in transformers too.
      raise UnsupportedConfigError(
          f"Gemma 4 {key}={value!r} is not supported yet (issue 41): only "
          f"{off!r} (models/families/gemma4.py); transformers' default "
          f"is {default!r}.")
  n = int(hf["num_hidden_layers"])
  types = _layer_types(hf, n)
  theta, scaling, local_theta = _rope(hf)
  heads = int(hf["num_attention_heads"])
  head_dim = int(hf.get("head_dim") or 256)  # transformers' defaults.
  kv_heads = int(hf.get("num_key_value_heads") or 4)
  global_dim, global_kv = _global_dims(hf, types, head_dim, kv_heads)
  ple = int(hf.get("hidden_size_per_layer_input", _PLE) or 0)
  if ple and int(hf.get("vocab_size_per_layer_input") or hf["vocab_size"]
                 ) != int(hf["vocab_size"]):
    raise UnsupportedConfigError(
        "Gemma 4 vocab_size_per_layer_input="
        f"{hf['vocab_size_per_layer_input']} != vocab_size="
        f"{hf['vocab_size']} is not supported (one table per token).")
  shared = int(hf.get("num_kv_shared_layers") or 0)
  return dict(
      vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]),
      intermediate_size=int(hf["intermediate_size"]), num_layers=n,
      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
      rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta,
      rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qk_norm=True,
      tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
      sliding_window=int(hf.get("sliding_window", 512) or 0),
      layer_types=types, query_pre_attn_scalar=1.0, norm_style="gemma4",
      mlp_activation="gelu_tanh",
      global_head_dim=0 if global_dim == head_dim else global_dim,
      global_kv_heads=0 if global_kv == kv_heads else global_kv,
      attention_k_eq_v=bool(hf.get("attention_k_eq_v", False)),
      final_logit_softcapping=float(hf.get("final_logit_softcapping") or 0),
      per_layer_input_size=ple, kv_shared_layers=shared,
      double_wide_mlp=bool(shared and hf.get("use_double_wide_mlp")))


def to_hf(cfg: Any) -> dict[str, Any]:
  """The HF `config.json` dict of a Gemma 4 `ModelConfig` `cfg`."""
  if (cfg.norm_style, cfg.mlp_activation, cfg.query_pre_attn_scalar) != (
      "gemma4", "gelu_tanh", 1.0) or (
          not cfg.qk_norm or cfg.qkv_bias or cfg.moe is not None or
          cfg.rotary_dim or cfg.nope_layers or cfg.qk_norm_full_width or
          cfg.mla or cfg.hybrid or cfg.attn_output_gate or
          cfg.layer_types[-1:] != ("full_attention",)):
    raise UnsupportedConfigError(
        f"{ARCH} needs norm_style='gemma4', mlp_activation='gelu_tanh', "
        "query_pre_attn_scalar=1, per-head q/k norms, layer_types ending in "
        "a full layer, no biases, experts, gate, MLA or linear layers and "
        f"RoPE on every layer; export as {cfg.hf_architecture()}.")
  types = list(cfg.layer_types)
  kv, dim, _ = cfg.attention_dims(types.index("full_attention"))
  return {
      **gemma3.gemma_to_hf(cfg, ARCH, MODEL_TYPE, types),
      "per_layer_config": {
          str(i): {"head_dim": dim, "num_key_value_heads": kv}
          for i, t in enumerate(types) if t == "full_attention"},
      "attention_k_eq_v": cfg.attention_k_eq_v,
      "final_logit_softcapping": cfg.final_logit_softcapping or None,
      "hidden_size_per_layer_input": cfg.per_layer_input_size,
      "vocab_size_per_layer_input": cfg.vocab_size,
      "num_kv_shared_layers": cfg.kv_shared_layers,
      "use_double_wide_mlp": cfg.double_wide_mlp,
      **{k: off for k, (_, off) in _REFUSED.items()},
  }


def _skipped(hf: Mapping[str, Any]) -> tuple[str, ...]:
  """The KV-shared layers' k/v tensors a checkpoint may hold (transformers
  ignores them too)."""
  n = int(hf["num_hidden_layers"])
  shared = int(hf.get("num_kv_shared_layers") or 0)
  return tuple(f"model.layers.{i}.self_attn.{name}"
               for i in range(n - shared, n)
               for name in ("k_proj", "v_proj", "k_norm", "v_norm"))


FAMILY = registry.register(registry.Family(
    architecture=ARCH, model_type=MODEL_TYPE, from_hf=from_hf, to_hf=to_hf,
    claims=lambda cfg: cfg.norm_style == "gemma4", priority=10,
    norm_names=gemma3.NORM_NAMES, skipped=_skipped))
